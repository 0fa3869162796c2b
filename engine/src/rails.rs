//! The engine's rails, whichever fabric runs them: starting them (devices, pollers pinned as
//! planned, the control plane), and registering memory on all of them in parallel.

use std::sync::Arc;
use std::time::Instant;

use std::net::IpAddr;

use railyard_control::{
    ControlConfig, ControlPlane, ControlRail, ControlShared, HostMode, HostRail, RailFabric,
};
use railyard_dataplane::fabric::faulted::Faulted;
use railyard_dataplane::fabric::host::HostFabric;
use railyard_dataplane::fabric::ofi::{OfiConfig, OfiError, OfiRail};
use railyard_dataplane::fabric::soft::{FaultHandle, SoftBuffer, SoftConfig, SoftDevice};
use railyard_dataplane::fabric::tcp::{ServedStats, TcpConfig, TcpDevice};
use railyard_dataplane::fabric::verbs::{RailConfig, VerbsFabric, VerbsRail};
use railyard_dataplane::fabric::{Access, Fabric, MemoryRegion};
use railyard_dataplane::{IdleStrategy, PollerConfig, PollerHandle, SpawnError};

use super::memory::HostMemory;
use super::{BuildError, MemoryError};

/// A rail before it starts: an RDMA device (verbs) or a software rail, and where its
/// poller runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PlannedRail {
    /// The RDMA device (verbs rails only).
    pub(crate) device: Option<String>,
    /// The device port, when the plan names one.
    pub(crate) port: Option<u8>,
    /// The PU its poller is pinned to.
    pub(crate) pu: Option<usize>,
    /// Its NUMA node.
    pub(crate) numa: u32,
}

/// The rails of one engine: all RDMA (verbs), all libfabric, or all host rails (soft and
/// TCP).
pub(crate) enum Rails {
    Host(Vec<HostRail>),
    Verbs(Vec<Arc<VerbsRail>>),
    /// libfabric rails, each with the fault plan its poller's fabric honours.
    Ofi(Vec<Arc<OfiRail>>, Vec<FaultHandle>),
}

/// Memory the engine allocated.
pub(crate) enum Memory {
    /// A soft buffer (registered on rail 0 by allocation; peers can map it).
    Soft(SoftBuffer),
    /// An anonymous mapping (registered on every rail by the engine).
    Host(HostMemory),
}

/// What starting the rails gives the engine.
pub(crate) struct Started {
    pub(crate) rails: Rails,
    pub(crate) pollers: Vec<Arc<PollerHandle>>,
    pub(crate) control: ControlPlane,
}

/// Spawns a rail's poller, pinned as planned, unpinned (with a warning) if the OS refuses.
fn spawn_poller<F: Fabric + 'static>(
    rail: usize,
    planned: &PlannedRail,
    idle: IdleStrategy,
    shared: &Arc<ControlShared>,
    fabric: impl Fn() -> Result<F, String>,
    warnings: &mut Vec<String>,
) -> Result<Arc<PollerHandle>, BuildError> {
    let config = PollerConfig {
        pin_pu: planned.pu,
        idle,
        ..PollerConfig::new(format!("railyard-rail{rail}"))
    };
    let failed = |error: SpawnError| BuildError::Poller {
        rail,
        reason: error.to_string(),
    };
    let spawn = |config: PollerConfig| {
        let fabric = fabric().map_err(|reason| BuildError::Rail { rail, reason })?;
        PollerHandle::spawn(config, fabric, shared.reprepare_hook(rail as u16)).map_err(failed)
    };
    let poller = match spawn(config.clone()) {
        Ok(poller) => poller,
        // A plan's core may not be ours to pin (containers, taskset): run unpinned.
        Err(BuildError::Poller { .. }) if config.pin_pu.is_some() => {
            let pu = config.pin_pu.unwrap_or_default();
            warnings.push(format!(
                "rail {rail}: cannot pin its poller to PU {pu}; unpinned"
            ));
            spawn(PollerConfig {
                pin_pu: None,
                ..config
            })?
        }
        Err(error) => return Err(error),
    };
    Ok(Arc::new(poller))
}

/// Rails of one fabric, their pollers and the control plane over them.
type StartedRails<R> = (Vec<R>, Vec<Arc<PollerHandle>>, ControlPlane);

/// Starts one rail per plan entry on fabric `F`, then the control plane over them.
fn start_all<R: RailFabric + Clone, F: Fabric + 'static>(
    planned: &[PlannedRail],
    idle: IdleStrategy,
    control: ControlConfig,
    shared: &Arc<ControlShared>,
    open: impl Fn(usize, &PlannedRail) -> Result<R, String>,
    fabric: impl Fn(usize, &R) -> Result<F, String>,
    warnings: &mut Vec<String>,
) -> Result<StartedRails<R>, BuildError> {
    let mut rails = Vec::new();
    let mut pollers = Vec::new();
    let mut control_rails = Vec::new();
    for (index, plan) in planned.iter().enumerate() {
        let rail = open(index, plan).map_err(|reason| BuildError::Rail {
            rail: index,
            reason,
        })?;
        let poller = spawn_poller(index, plan, idle, shared, || fabric(index, &rail), warnings)?;
        control_rails.push(ControlRail {
            fabric: rail.clone(),
            poller: poller.clone(),
        });
        rails.push(rail);
        pollers.push(poller);
    }
    let control = ControlPlane::start(control, control_rails, shared.clone())?;
    Ok((rails, pollers, control))
}

impl Rails {
    /// Starts the planned rails as host rails: the soft fabric and TCP on one poller each,
    /// TCP data ports on `bind` (set up as `tcp` says), initiating per `mode`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_host(
        name: &str,
        planned: &[PlannedRail],
        (mode, bind): (HostMode, IpAddr),
        tcp: &TcpConfig,
        idle: IdleStrategy,
        control: ControlConfig,
        shared: &Arc<ControlShared>,
        warnings: &mut Vec<String>,
    ) -> Result<Started, BuildError> {
        let (rails, pollers, control) = start_all(
            planned,
            idle,
            control,
            shared,
            |index, _| {
                let soft = SoftDevice::open(format!("{name}-soft{index}"), SoftConfig::default())
                    .map_err(|e| e.to_string())?;
                let tcp = TcpDevice::open(&soft, bind, tcp.clone()).map_err(|e| e.to_string())?;
                Ok(HostRail { soft, tcp, mode })
            },
            |_, rail: &HostRail| HostFabric::new(&rail.soft, &rail.tcp).map_err(|e| e.to_string()),
            warnings,
        )?;
        Ok(Started {
            rails: Self::Host(rails),
            pollers,
            control,
        })
    }

    /// Starts the planned RDMA rails on the verbs fabric.
    pub(crate) fn start_verbs(
        planned: &[PlannedRail],
        verbs: RailConfig,
        idle: IdleStrategy,
        control: ControlConfig,
        shared: &Arc<ControlShared>,
        warnings: &mut Vec<String>,
    ) -> Result<Started, BuildError> {
        let (rails, pollers, control) = start_all(
            planned,
            idle,
            control,
            shared,
            |index, plan| {
                let device = plan
                    .device
                    .as_deref()
                    .ok_or_else(|| format!("rail {index} has no RDMA device"))?;
                let config = RailConfig {
                    port: verbs.port.or(plan.port),
                    ..verbs
                };
                VerbsRail::open(device, config).map_err(|e| e.to_string())
            },
            |_, rail: &Arc<VerbsRail>| Ok(VerbsFabric::new(rail.clone())),
            warnings,
        )?;
        Ok(Started {
            rails: Self::Verbs(rails),
            pollers,
            control,
        })
    }

    /// Starts the planned rails on libfabric's `provider`: an RDMA rail of the plan (an EFA
    /// device) opens the provider's domain of that device, a software rail the provider's
    /// first domain.
    pub(crate) fn start_ofi(
        name: &str,
        planned: &[PlannedRail],
        provider: &str,
        idle: IdleStrategy,
        control: ControlConfig,
        shared: &Arc<ControlShared>,
        warnings: &mut Vec<String>,
    ) -> Result<Started, BuildError> {
        let faults: Vec<FaultHandle> = planned.iter().map(|_| FaultHandle::default()).collect();
        let (rails, pollers, control) = start_all(
            planned,
            idle,
            control,
            shared,
            |index, plan| {
                let config = OfiConfig {
                    provider: provider.to_string(),
                    // efa names a device's reliable-datagram domain `<device>-rdm`.
                    domain: plan.device.as_ref().map(|device| format!("{device}-rdm")),
                };
                OfiRail::open(format!("{name}-ofi{index}"), &config).map_err(|e| e.to_string())
            },
            |index, rail: &Arc<OfiRail>| {
                let fabric = rail.fabric().map_err(|e| e.to_string())?;
                Ok(Faulted::new(fabric, faults[index].clone()))
            },
            warnings,
        )?;
        Ok(Started {
            rails: Self::Ofi(rails, faults),
            pollers,
            control,
        })
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Host(rails) => rails.len(),
            Self::Verbs(rails) => rails.len(),
            Self::Ofi(rails, _) => rails.len(),
        }
    }

    /// The fabric's name.
    pub(crate) fn fabric(&self) -> &'static str {
        match self {
            Self::Host(rails) => match rails.first().map(|rail| rail.mode) {
                Some(HostMode::Soft) => "soft",
                Some(HostMode::Tcp) => "tcp",
                Some(HostMode::Auto) | None => "soft+tcp",
            },
            Self::Verbs(_) => "verbs",
            Self::Ofi(..) => "ofi",
        }
    }

    /// Rail `index`'s fault plan (host rails: its soft and TCP queue pairs; libfabric rails:
    /// applied in front of the provider). Verbs rails have none.
    pub(crate) fn faults(&self, index: usize) -> Option<FaultHandle> {
        match self {
            Self::Host(rails) => rails.get(index).map(|rail| rail.soft.faults()),
            Self::Ofi(_, faults) => faults.get(index).cloned(),
            Self::Verbs(_) => None,
        }
    }

    /// What rail `index`'s TCP target side carried out for initiators (host rails only:
    /// nothing else reaches this process's CPU).
    pub(crate) fn served(&self, index: usize) -> Option<ServedStats> {
        match self {
            Self::Host(rails) => rails.get(index).map(|rail| rail.tcp.served()),
            Self::Verbs(_) | Self::Ofi(..) => None,
        }
    }

    /// Rail `index`'s name.
    pub(crate) fn name(&self, index: usize) -> String {
        match self {
            Self::Host(rails) => rails
                .get(index)
                .map_or(String::new(), |r| r.soft.name().to_string()),
            Self::Verbs(rails) => rails
                .get(index)
                .map_or(String::new(), |r| r.name().to_string()),
            Self::Ofi(rails, _) => rails
                .get(index)
                .map_or(String::new(), |r| r.name().to_string()),
        }
    }

    /// Allocates `len` bytes of the kind this fabric registers best (a soft buffer comes
    /// registered on the first rail with `access`).
    pub(crate) fn allocate(&self, len: u64, access: Access) -> Result<Memory, MemoryError> {
        let failed = |reason: String| MemoryError::Alloc { len, reason };
        let size = usize::try_from(len).map_err(|_| failed("too large for this host".into()))?;
        match self {
            Self::Host(rails) => rails[0]
                .soft
                .alloc(size, access)
                .map(Memory::Soft)
                .map_err(|e| failed(e.to_string())),
            Self::Verbs(_) | Self::Ofi(..) => HostMemory::new(size)
                .map(Memory::Host)
                .map_err(|e| failed(e.to_string())),
        }
    }

    /// Registers allocated memory on every rail (in parallel) with `access`. A soft buffer
    /// comes registered on the first rail; `fresh_keys` registers it there again (new keys,
    /// for [`Engine::reregister`](super::Engine::reregister)) instead of reusing that one.
    pub(crate) fn register_memory(
        &self,
        memory: &Memory,
        len: u64,
        fresh_keys: bool,
        access: Access,
    ) -> Result<Vec<MemoryRegion>, MemoryError> {
        match (self, memory) {
            (Self::Host(rails), Memory::Soft(buffer)) => {
                let first = usize::from(!fresh_keys);
                let mut registrations = Vec::new();
                if !fresh_keys {
                    registrations.push(buffer.region());
                }
                registrations.extend(
                    register_all(
                        &rails[first..],
                        first,
                        &[(buffer.region().addr, len)],
                        |rail, _, _| {
                            // SAFETY: the engine keeps the buffer until these registrations
                            // are withdrawn (`deregister` runs before the memory drops).
                            unsafe { rail.soft.register_buffer(buffer, access) }
                                .map_err(|e| e.to_string())
                        },
                        |rail, region| {
                            let _ = rail.soft.deregister(region);
                        },
                    )?
                    .into_iter()
                    .flatten(),
                );
                Ok(registrations)
            }
            (Self::Verbs(_) | Self::Ofi(..), Memory::Host(host)) => {
                // SAFETY: the engine keeps the mapping until these registrations go.
                unsafe { self.register_user(host.addr(), len, access) }
            }
            _ => Err(MemoryError::Alloc {
                len,
                reason: "memory of another fabric".into(),
            }),
        }
    }

    /// Registers `len` bytes at `addr` on every rail (in parallel) with `access`.
    ///
    /// # Safety
    /// The memory stays mapped until [`Self::deregister`] has withdrawn the registrations.
    pub(crate) unsafe fn register_user(
        &self,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<Vec<MemoryRegion>, MemoryError> {
        // SAFETY: forwarded from the caller.
        let mut registered = unsafe { self.register_user_many(&[(addr, len)], access) }?;
        Ok(registered.pop().unwrap_or_default())
    }

    /// Registers each `(addr, len)` on every rail with `access`: one thread per rail
    /// registers them all, the rails in parallel. Answers each range's registrations, in
    /// rail order; on any refusal, every registration made is withdrawn.
    ///
    /// # Safety
    /// The memory stays mapped until [`Self::deregister`] has withdrawn the registrations.
    pub(crate) unsafe fn register_user_many(
        &self,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<Vec<MemoryRegion>>, MemoryError> {
        match self {
            Self::Host(rails) => register_all(
                rails,
                0,
                ranges,
                |rail, addr, len| {
                    // SAFETY: forwarded from the caller.
                    unsafe { rail.soft.register(addr as *const u8, len as usize, access) }
                        .map_err(|e| e.to_string())
                },
                |rail, region| {
                    let _ = rail.soft.deregister(region);
                },
            ),
            Self::Verbs(rails) => register_all(
                rails,
                0,
                ranges,
                |rail, addr, len| {
                    // SAFETY: forwarded from the caller.
                    let (lkey, rkey) =
                        unsafe { rail.register(addr as *mut u8, len as usize, access) }
                            .map_err(|e| e.to_string())?;
                    Ok(MemoryRegion {
                        addr,
                        len,
                        lkey,
                        rkey,
                        access,
                    })
                },
                |rail, region| {
                    rail.deregister(region.rkey);
                },
            ),
            Self::Ofi(rails, _) => register_all(
                rails,
                0,
                ranges,
                |rail, addr, len| {
                    // SAFETY: forwarded from the caller.
                    unsafe { rail.register(addr, len, access) }.map_err(|e| e.to_string())
                },
                |rail, region| {
                    let _ = rail.deregister(region);
                },
            ),
        }
    }

    /// Withdraws registrations made by [`Self::register_memory`] or
    /// [`Self::register_user`] (a soft buffer's own too: its drop then finds it gone), from
    /// every rail. Idempotent: a registration a rail no longer has is withdrawn already, so a
    /// failed withdrawal is retried by calling again with the same registrations.
    ///
    /// # Errors
    /// The first rail that refused, with its error: that rail keeps the registration, and
    /// the memory must stay mapped until a later call succeeds.
    pub(crate) fn deregister(&self, registrations: &[MemoryRegion]) -> Result<(), (usize, String)> {
        let mut refused = None;
        match self {
            Self::Host(rails) => {
                for (rail, region) in rails.iter().zip(registrations) {
                    // Its only error is an unknown key: withdrawn already.
                    let _ = rail.soft.deregister(region);
                }
            }
            Self::Verbs(rails) => {
                for (rail, region) in rails.iter().zip(registrations) {
                    // Dropping the registration deregisters it; none left is withdrawn already.
                    rail.deregister(region.rkey);
                }
            }
            Self::Ofi(rails, _) => {
                for (index, (rail, region)) in rails.iter().zip(registrations).enumerate() {
                    match rail.deregister(region) {
                        Ok(()) | Err(OfiError::NotRegistered { .. }) => {}
                        Err(error) => {
                            refused.get_or_insert((index, error.to_string()));
                        }
                    }
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }

    /// Whether [`Engine::revoke`](super::Engine::revoke) can fence a peer on these rails;
    /// else the fabric's name. Soft and TCP queue pairs are this engine's to close, a verbs
    /// queue pair's destruction stops the NIC; a libfabric reliable-datagram endpoint keeps
    /// nothing per initiator to take away (RMA goes by key alone).
    pub(crate) fn fence_unsupported(&self) -> Option<&'static str> {
        match self {
            Self::Host(_) | Self::Verbs(_) => None,
            Self::Ofi(..) => Some("libfabric"),
        }
    }

    /// After [`Self::deregister`]: true once no peer process is inside a copy into or out of
    /// this engine's memory that it checked before the withdrawal (soft fabric: peers copy
    /// themselves; TCP and verbs peers only reach memory through this engine's pollers or
    /// its NIC, whose deregistration fences itself; libfabric likewise). False if `deadline`
    /// passes first.
    pub(crate) fn quiesce_peers(&self, deadline: Instant) -> bool {
        match self {
            Self::Host(rails) => rails.iter().all(|rail| rail.soft.quiesce_peers(deadline)),
            // Peers reach memory only through this engine's pollers (a manual-progress
            // provider) or its NIC, and fi_close of a registration fences the NIC.
            Self::Verbs(_) | Self::Ofi(..) => true,
        }
    }
}

impl Memory {
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Self::Soft(buffer) => buffer.region().addr,
            Self::Host(host) => host.addr(),
        }
    }

    pub(crate) fn backing(&self) -> railyard_dataplane::fabric::soft::Backing {
        match self {
            Self::Soft(buffer) => buffer.backing(),
            Self::Host(host) => host.backing(),
        }
    }

    /// The bytes, for NUMA binding before anything touches them.
    ///
    /// # Safety
    /// Nothing may write the memory while the slice lives.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        match self {
            // SAFETY: forwarded from the caller.
            Self::Soft(buffer) => unsafe { buffer.as_slice() },
            // SAFETY: forwarded from the caller.
            Self::Host(host) => unsafe { host.as_slice() },
        }
    }

    pub(crate) fn prefault(&mut self) {
        match self {
            Self::Soft(buffer) => buffer.prefault(),
            Self::Host(host) => host.prefault(),
        }
    }
}

/// Registers each of `ranges` on each of `rails`: one thread per rail, in parallel, each
/// registering every range in order; `first` is the index of `rails[0]` (for errors).
/// Answers, per range, its registrations in rail order. On any failure every registration
/// made is withdrawn and the first error (by range, then rail) is returned.
fn register_all<R: Sync>(
    rails: &[R],
    first: usize,
    ranges: &[(u64, u64)],
    register: impl Fn(&R, u64, u64) -> Result<MemoryRegion, String> + Sync,
    deregister: impl Fn(&R, &MemoryRegion) + Sync,
) -> Result<Vec<Vec<MemoryRegion>>, MemoryError> {
    // Per rail: the registrations it made, and the first range it could not register.
    type RailOutcome = (Vec<MemoryRegion>, Option<(usize, String)>);
    let outcomes: Vec<RailOutcome> = std::thread::scope(|scope| {
        let register = &register;
        let running: Vec<_> = rails
            .iter()
            .map(|rail| {
                scope.spawn(move || {
                    let mut made = Vec::with_capacity(ranges.len());
                    for (index, &(addr, len)) in ranges.iter().enumerate() {
                        match register(rail, addr, len) {
                            Ok(region) => made.push(region),
                            Err(reason) => return (made, Some((index, reason))),
                        }
                    }
                    (made, None)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|thread| {
                thread.join().unwrap_or_else(|_| {
                    (
                        Vec::new(),
                        Some((0, "the registration thread panicked".to_string())),
                    )
                })
            })
            .collect()
    });
    let failure = outcomes
        .iter()
        .enumerate()
        .filter_map(|(offset, (_, failed))| {
            failed.as_ref().map(|(index, why)| (*index, offset, why))
        })
        .min_by_key(|&(index, offset, _)| (index, offset))
        .map(|(index, offset, reason)| {
            let (addr, len) = ranges[index];
            MemoryError::Register {
                rail: first + offset,
                addr,
                len,
                reason: reason.clone(),
            }
        });
    if let Some(error) = failure {
        for (rail, (made, _)) in rails.iter().zip(&outcomes) {
            for region in made {
                deregister(rail, region);
            }
        }
        return Err(error);
    }
    let mut per_range: Vec<Vec<MemoryRegion>> = (0..ranges.len())
        .map(|_| Vec::with_capacity(rails.len()))
        .collect();
    for (made, _) in outcomes {
        for (range, region) in per_range.iter_mut().zip(made) {
            range.push(region);
        }
    }
    Ok(per_range)
}
