//! The planning rules: which RDMA devices become rails, where each rail's poller runs, and
//! which rails each CPU node and GPU should prefer. Pure functions of a [`Machine`] and
//! [`PlanOptions`]: no hwloc, no OS, so the same input always gives the same [`Plan`].
//!
//! # Rails
//! A NIC becomes a rail when it has an ACTIVE port on the *primary fabric*: the link layer
//! with the most aggregate active bandwidth (InfiniBand wins a tie). Within that fabric a
//! port slower than half the fastest port is a management port, not a rail. Every device not
//! chosen is listed in [`Plan::skipped`] with a reason. [`NicSelection`] restricts or extends
//! the choice. When no device qualifies the plan has software rails, one per NUMA node that
//! has CPUs unless [`PlanOptions::soft_rails`] says otherwise.
//!
//! # Placement
//! Each rail gets one poller PU: the first PU of a physical core on the rail's NUMA node,
//! never a core another poller has (so never an SMT sibling of one), skipping the first
//! [`PlanOptions::reserve_cores_per_node`] cores of each node, which are left to the OS.
//! When the rail's node has no free core the poller goes to the nearest node that has one
//! (by the firmware's NUMA distances, else by node number). When the machine has fewer free
//! cores than rails, pollers share the least-loaded core, and when there is no unreserved
//! core at all, they use reserved ones. Every such compromise is written to
//! [`Plan::warnings`].

use std::collections::BTreeMap;
use std::num::NonZeroUsize;

use serde::Serialize;

use crate::TopologyError;
use crate::model::{LinkLayer, Machine, Nic, PciDistance, Port, Source};

/// Options of [`Plan::build`]; `Default` is what the CLI does without flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Cores at the start of each NUMA node left to the OS (default 1).
    pub reserve_cores_per_node: usize,
    /// Allow/deny list of RDMA devices (`--nics`, `RAILYARD_NICS`).
    pub nics: Option<NicSelection>,
    /// Number of software rails when no RDMA device qualifies (default: one per NUMA node
    /// with CPUs).
    pub soft_rails: Option<NonZeroUsize>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            reserve_cores_per_node: 1,
            nics: None,
            soft_rails: None,
        }
    }
}

/// An allow/deny list of RDMA devices, parsed from a comma-separated list.
///
/// - `mlx5_0,mlx5_3`: exactly these devices (when they have an active port);
/// - `+mlx5_7`: this device in addition to the automatic choice, even off the primary fabric;
/// - `-mlx5_4` (or `^mlx5_4`, `!mlx5_4`): never this device.
///
/// Forms combine: `mlx5_0,mlx5_3,-mlx5_3` is `mlx5_0`. A name that is not an RDMA device of
/// the machine is an error at planning time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicSelection {
    only: Vec<String>,
    add: Vec<String>,
    remove: Vec<String>,
}

impl NicSelection {
    /// Parses a list such as `mlx5_0,+mlx5_7,-mlx5_3`.
    ///
    /// # Errors
    /// [`TopologyError::InvalidNicList`] for an empty list or an entry that is only a sign.
    pub fn parse(list: &str) -> Result<Self, TopologyError> {
        let mut selection = Self::default();
        for entry in list
            .split([',', ' '])
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let (target, name) = match entry.as_bytes()[0] {
                b'+' => (&mut selection.add, &entry[1..]),
                b'-' | b'^' | b'!' => (&mut selection.remove, &entry[1..]),
                _ => (&mut selection.only, entry),
            };
            if name.is_empty() {
                return Err(TopologyError::InvalidNicList {
                    entry: entry.to_owned(),
                    reason: "a sign must be followed by a device name",
                });
            }
            target.push(name.to_owned());
        }
        if selection == Self::default() {
            return Err(TopologyError::InvalidNicList {
                entry: list.to_owned(),
                reason: "the list names no device",
            });
        }
        Ok(selection)
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.only.iter().chain(&self.add).chain(&self.remove)
    }

    fn explicitly_wanted(&self, name: &str) -> bool {
        self.only.iter().chain(&self.add).any(|n| n == name)
    }
}

/// What drives a rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RailKind {
    /// An RDMA device port.
    Rdma,
    /// A software rail: the poller moves bytes itself (no RDMA device).
    Software,
}

/// One rail and where its poller runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Rail {
    /// Device name (`mlx5_0`) or software rail name (`soft0`).
    pub name: String,
    /// RDMA or software.
    pub kind: RailKind,
    /// Link layer of the rail's port (RDMA only).
    pub link_layer: Option<LinkLayer>,
    /// Rate of the rail's port in Gb/s (RDMA only, when known).
    pub rate_gbps: Option<u32>,
    /// The NUMA node the rail belongs to.
    pub numa_node: u32,
    /// PCI bus id of the device (RDMA only).
    pub pci_busid: Option<String>,
    /// The PU (OS index) the rail's poller is pinned to.
    pub poller_pu: u32,
    /// The port number the rail uses (RDMA only).
    #[serde(skip)]
    pub port: Option<u32>,
}

/// An RDMA device that is not a rail, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Device name.
    pub name: String,
    /// Why it is not a rail, in words a person understands.
    pub reason: String,
}

/// A NUMA node as listed in the plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NumaSummary {
    /// OS index.
    pub os_index: u32,
    /// OS indices of its PUs.
    pub pus: Vec<u32>,
}

/// A GPU and its distance to every rail and RDMA device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuPlacement {
    /// GPU name.
    pub name: String,
    /// PCI bus id.
    pub pci_busid: String,
    /// NUMA node.
    pub numa_node: u32,
    /// The rails at the smallest distance class from this GPU.
    pub preferred_rails: Vec<String>,
    /// Distance class to every RDMA device and software rail, by name.
    pub distance: BTreeMap<String, PciDistance>,
}

/// Preferred rails first, the other rails second.
pub type RailPreference = (Vec<String>, Vec<String>);

/// The plan for one machine; its JSON form is the `railyard topology --json` output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Host name.
    pub host: String,
    /// Live host or XML snapshot.
    pub source: Source,
    /// NUMA nodes and their PUs.
    pub numa_nodes: Vec<NumaSummary>,
    /// The rails, in PCI discovery order (software rails by number).
    pub rails: Vec<Rail>,
    /// RDMA devices that are not rails.
    pub skipped: Vec<Skipped>,
    /// GPUs with their distances and preferred rails.
    pub gpus: Vec<GpuPlacement>,
    /// `cpu:<numa>` and GPU names → (preferred rails, other rails).
    pub affinity: BTreeMap<String, RailPreference>,
    /// Compromises a person should know about.
    pub warnings: Vec<String>,
}

/// A rail chosen before placement.
struct Chosen<'m> {
    nic: Option<&'m Nic>,
    name: String,
    numa_node: u32,
    port: Option<&'m Port>,
}

impl Plan {
    /// Applies the rules of this module to `machine`.
    ///
    /// # Errors
    /// [`TopologyError::UnknownNic`] when `options.nics` names a device the machine lacks.
    pub fn build(machine: &Machine, options: &PlanOptions) -> Result<Self, TopologyError> {
        let mut warnings = Vec::new();
        let (mut chosen, skipped) = choose_rdma_rails(machine, options, &mut warnings)?;
        if chosen.is_empty() {
            chosen = software_rails(machine, options.soft_rails);
        } else if let Some(count) = options.soft_rails {
            warnings.push(format!(
                "--soft-rails {count} ignored: {} RDMA rail(s) qualify",
                chosen.len()
            ));
        }
        let poller_pus = place_pollers(
            machine,
            &chosen,
            options.reserve_cores_per_node,
            &mut warnings,
        );
        let rails: Vec<Rail> = chosen
            .iter()
            .zip(poller_pus)
            .map(|(c, poller_pu)| Rail {
                name: c.name.clone(),
                kind: if c.nic.is_some() {
                    RailKind::Rdma
                } else {
                    RailKind::Software
                },
                link_layer: c.port.and_then(|p| p.link_layer),
                rate_gbps: c.port.and_then(|p| p.rate_gbps),
                numa_node: c.numa_node,
                pci_busid: c.nic.and_then(|n| n.pci_busid.clone()),
                poller_pu,
                port: c.port.map(|p| p.number),
            })
            .collect();
        let (gpus, affinity) = affinities(machine, &chosen);
        Ok(Self {
            host: machine.host.clone(),
            source: machine.source,
            numa_nodes: machine
                .numa_nodes
                .iter()
                .map(|n| NumaSummary {
                    os_index: n.os_index,
                    pus: n.pus.clone(),
                })
                .collect(),
            rails,
            skipped,
            gpus,
            affinity,
            warnings,
        })
    }
}

/// The automatic verdict on one device: the port it would use as a rail, or why not.
type Verdict<'m> = Result<&'m Port, String>;

fn choose_rdma_rails<'m>(
    machine: &'m Machine,
    options: &PlanOptions,
    warnings: &mut Vec<String>,
) -> Result<(Vec<Chosen<'m>>, Vec<Skipped>), TopologyError> {
    if let Some(selection) = &options.nics {
        for name in selection.names() {
            if !machine.nics.iter().any(|nic| &nic.name == name) {
                let known: Vec<&str> = machine.nics.iter().map(|n| n.name.as_str()).collect();
                return Err(TopologyError::UnknownNic {
                    name: name.clone(),
                    known: if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    },
                });
            }
        }
    }
    let verdicts = automatic_verdicts(machine);
    let mut chosen = Vec::new();
    let mut skipped = Vec::new();
    for (nic, verdict) in machine.nics.iter().zip(verdicts) {
        let selection = options.nics.as_ref();
        let removed = selection.is_some_and(|s| s.remove.contains(&nic.name));
        let wanted = selection.is_some_and(|s| s.explicitly_wanted(&nic.name));
        let outside_only = selection.is_some_and(|s| !s.only.is_empty() && !wanted);
        let decision: Verdict<'m> = if removed {
            Err("excluded by --nics".to_owned())
        } else if wanted {
            match verdict {
                Ok(port) => Ok(port),
                Err(reason) => match nic.ports.iter().find(|p| p.state.is_active()) {
                    Some(port) => {
                        warnings.push(format!(
                            "{} is a rail because --nics names it, although: {reason}",
                            nic.name
                        ));
                        Ok(port)
                    }
                    None => {
                        warnings.push(format!("--nics names {}, but {reason}", nic.name));
                        Err(format!("{reason} (named in --nics)"))
                    }
                },
            }
        } else if outside_only {
            Err(match verdict {
                Ok(_) => "not in --nics".to_owned(),
                Err(reason) => reason,
            })
        } else {
            verdict
        };
        match decision {
            Ok(port) => chosen.push(Chosen {
                nic: Some(nic),
                name: nic.name.clone(),
                numa_node: nic.numa_node,
                port: Some(port),
            }),
            Err(reason) => skipped.push(Skipped {
                name: nic.name.clone(),
                reason,
            }),
        }
    }
    Ok((chosen, skipped))
}

/// The rail rules without any user selection, one verdict per device in `machine.nics`.
fn automatic_verdicts(machine: &Machine) -> Vec<Verdict<'_>> {
    let active = || {
        machine
            .nics
            .iter()
            .flat_map(|nic| &nic.ports)
            .filter(|p| p.state.is_active())
    };
    let mut bandwidth: BTreeMap<LinkLayer, u64> = BTreeMap::new();
    for port in active() {
        if let Some(layer) = port.link_layer {
            *bandwidth.entry(layer).or_default() += u64::from(port.rate_gbps.unwrap_or(0));
        }
    }
    // max_by_key keeps the last maximum; iterate in reverse so the first layer (InfiniBand)
    // wins a tie.
    let primary = bandwidth
        .iter()
        .rev()
        .max_by_key(|(_, bw)| **bw)
        .map(|(layer, _)| *layer);
    let fastest = active()
        .filter(|p| p.link_layer == primary)
        .filter_map(|p| p.rate_gbps)
        .max()
        .unwrap_or(0);
    let is_management = |port: &Port| port.rate_gbps.is_some_and(|rate| rate * 2 < fastest);

    machine
        .nics
        .iter()
        .map(|nic| {
            let active: Vec<&Port> = nic.ports.iter().filter(|p| p.state.is_active()).collect();
            if active.is_empty() {
                return Err(describe_inactive(&nic.ports));
            }
            let on_primary: Vec<&Port> = active
                .iter()
                .copied()
                .filter(|p| p.link_layer == primary)
                .collect();
            let Some(first_on_primary) = on_primary.first() else {
                let layer = active[0]
                    .link_layer
                    .map_or("unknown link layer", LinkLayer::as_str);
                let primary = primary.map_or("unknown", LinkLayer::as_str);
                return Err(format!("{layer}, but the primary fabric is {primary}"));
            };
            match on_primary.iter().find(|p| !is_management(p)) {
                Some(port) => Ok(*port),
                None => Err(format!(
                    "{} Gb/s, below the {fastest} Gb/s fabric",
                    first_on_primary.rate_gbps.unwrap_or(0)
                )),
            }
        })
        .collect()
}

fn describe_inactive(ports: &[Port]) -> String {
    if ports.is_empty() {
        return "no port reported".to_owned();
    }
    ports
        .iter()
        .map(|p| format!("port {} {}", p.number, p.state.describe()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn software_rails(machine: &Machine, count: Option<NonZeroUsize>) -> Vec<Chosen<'_>> {
    let mut homes: Vec<u32> = machine
        .numa_nodes
        .iter()
        .filter(|n| !n.cores.is_empty())
        .map(|n| n.os_index)
        .collect();
    if homes.is_empty() {
        homes.push(machine.numa_nodes.first().map_or(0, |n| n.os_index));
    }
    let count = count.map_or(homes.len(), NonZeroUsize::get);
    (0..count)
        .map(|i| Chosen {
            nic: None,
            name: format!("soft{i}"),
            numa_node: homes[i % homes.len()],
            port: None,
        })
        .collect()
}

/// A physical core a poller may take.
struct Slot {
    node: u32,
    pu: u32,
    reserved: bool,
    /// Names of the rails whose pollers run here.
    pollers: Vec<String>,
}

fn place_pollers(
    machine: &Machine,
    rails: &[Chosen<'_>],
    reserve: usize,
    warnings: &mut Vec<String>,
) -> Vec<u32> {
    let mut slots: Vec<Slot> = machine
        .numa_nodes
        .iter()
        .flat_map(|node| {
            node.cores.iter().enumerate().map(move |(i, core)| Slot {
                node: node.os_index,
                pu: core.primary_pu(),
                reserved: i < reserve,
                pollers: Vec::new(),
            })
        })
        .collect();
    if slots.is_empty() {
        // A snapshot without CPUs cannot run pollers; plan PU 0 and say so.
        warnings.push("the topology lists no CPU: every poller is planned on PU 0".to_owned());
        return rails.iter().map(|_| 0).collect();
    }
    let any_unreserved = slots.iter().any(|s| !s.reserved);
    rails
        .iter()
        .map(|rail| {
            let nearness = |slot: &Slot| (numa_nearness(machine, rail.numa_node, slot.node), slot.node);
            // Slots keep machine order within a node, so `min_by_key` picks the first best.
            let pick = slots
                .iter()
                .enumerate()
                .filter(|(_, s)| !(any_unreserved && s.reserved))
                .min_by_key(|(_, s)| (s.pollers.len(), nearness(s)))
                .map_or(0, |(i, _)| i);
            let slot = &mut slots[pick];
            if slot.node != rail.numa_node {
                warnings.push(format!(
                    "rail {}: NUMA node {} has no free core, so its poller runs on PU {} of NUMA node {}",
                    rail.name, rail.numa_node, slot.pu, slot.node
                ));
            }
            if let Some(first) = slot.pollers.first() {
                warnings.push(format!(
                    "rail {} shares the core of PU {} with rail {first}: fewer free cores than rails",
                    rail.name, slot.pu
                ));
            }
            if slot.reserved {
                warnings.push(format!(
                    "rail {} polls on PU {}, a core reserved for the OS: no unreserved core exists",
                    rail.name, slot.pu
                ));
            }
            slot.pollers.push(rail.name.clone());
            slot.pu
        })
        .collect()
}

/// How far `to` is from `from`: the firmware's distance when known, else the difference of
/// node numbers.
fn numa_nearness(machine: &Machine, from: u32, to: u32) -> u64 {
    let index = |os: u32| machine.numa_nodes.iter().position(|n| n.os_index == os);
    if let (Some(matrix), Some(i), Some(j)) = (&machine.numa_distances, index(from), index(to)) {
        return matrix[i][j];
    }
    u64::from(from.abs_diff(to))
}

fn affinities(
    machine: &Machine,
    rails: &[Chosen<'_>],
) -> (Vec<GpuPlacement>, BTreeMap<String, RailPreference>) {
    let mut affinity = BTreeMap::new();
    for node in &machine.numa_nodes {
        let classes = rails.iter().map(|rail| {
            (
                rail.name.clone(),
                PciDistance::between_nodes(node.os_index, rail.numa_node),
            )
        });
        affinity.insert(format!("cpu:{}", node.os_index), split_preferred(classes));
    }
    let mut gpus = Vec::new();
    for gpu in &machine.gpus {
        let to_nic = |nic: &Nic| {
            PciDistance::between(&gpu.pci_path, gpu.numa_node, &nic.pci_path, nic.numa_node)
        };
        let to_rail = |rail: &Chosen<'_>| match rail.nic {
            Some(nic) => to_nic(nic),
            None => PciDistance::between_nodes(gpu.numa_node, rail.numa_node),
        };
        let mut distance: BTreeMap<String, PciDistance> = machine
            .nics
            .iter()
            .map(|nic| (nic.name.clone(), to_nic(nic)))
            .collect();
        distance.extend(rails.iter().map(|rail| (rail.name.clone(), to_rail(rail))));
        let preference =
            split_preferred(rails.iter().map(|rail| (rail.name.clone(), to_rail(rail))));
        gpus.push(GpuPlacement {
            name: gpu.name.clone(),
            pci_busid: gpu.pci_busid.clone(),
            numa_node: gpu.numa_node,
            preferred_rails: preference.0.clone(),
            distance,
        });
        affinity.insert(gpu.name.clone(), preference);
    }
    (gpus, affinity)
}

/// Splits rails into those at the smallest distance class (all of them on a tie) and the rest.
fn split_preferred(classes: impl Iterator<Item = (String, PciDistance)>) -> RailPreference {
    let classes: Vec<(String, PciDistance)> = classes.collect();
    let best = classes.iter().map(|(_, class)| *class).min();
    let (mut preferred, mut others) = (Vec::new(), Vec::new());
    for (name, class) in classes {
        if Some(class) == best {
            &mut preferred
        } else {
            &mut others
        }
        .push(name);
    }
    (preferred, others)
}
