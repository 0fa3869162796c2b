//! A process's worth of railyard for the scenarios: rails (soft, or libfabric's), their
//! pollers, a control plane, and registered memory — the pieces the Engine API owns, wired by
//! hand. Every poller's fabric is wrapped in an [`Observed`] fabric that checks, at the
//! fabric boundary and independently of the poller, that no work request is posted on a
//! queue pair newer than the epoch it was prepared for. A libfabric rail's fabric is also
//! wrapped in [`Faulted`], so that the scenarios' fault plans apply to it as to a soft one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use railyard_engine::control::{
    ControlConfig, ControlPlane, ControlRail, ControlShared, Incarnation, Policy, RegionDescriptor,
};
use railyard_engine::dataplane::fabric::faulted::Faulted;
use railyard_engine::dataplane::fabric::ofi::{OfiConfig, OfiRail};
use railyard_engine::dataplane::fabric::soft::{FaultHandle, SoftBuffer, SoftConfig, SoftDevice};
use railyard_engine::dataplane::fabric::{
    Access, AsyncEvent, Fabric, FabricError, FabricLimits, MemoryRegion, PostError, QpNum,
    WcStatus, WorkCompletion, WorkRequest,
};
use railyard_engine::dataplane::{EndpointId, Epoch, IdleStrategy, PollerConfig, PollerHandle};
use railyard_engine::memory::HostMemory;

use super::fabric::ChaosFabric;

/// What an [`Observed`] fabric saw.
#[derive(Debug, Default)]
pub struct Observations {
    /// Work requests posted with an epoch older than their queue pair's.
    pub stale_posts: AtomicU64,
    /// Work requests posted.
    pub posted: AtomicU64,
    /// Queue pairs connected.
    pub connects: AtomicU64,
    /// Error completions by status (index: [`status_index`]).
    pub errors: [AtomicU64; 7],
    /// QP-fatal events.
    pub fatal_events: AtomicU64,
    /// Error completions other than flushes on any queue pair but the first connected: a
    /// queue pair taken down after a reconnect.
    pub late_errors: AtomicU64,
}

/// A dense index of a completion status.
pub fn status_index(status: WcStatus) -> usize {
    match status {
        WcStatus::Success => 0,
        WcStatus::LocLenErr => 1,
        WcStatus::LocProtErr => 2,
        WcStatus::RemAccessErr => 3,
        WcStatus::RemInvReqErr => 4,
        WcStatus::RetryExcErr => 5,
        WcStatus::WrFlushErr => 6,
    }
}

/// A fabric wrapper that records each queue pair's epoch at connect and checks every
/// posted request against it.
pub struct Observed<F> {
    inner: F,
    epochs: HashMap<QpNum, Epoch>,
    first_qp: Option<QpNum>,
    seen: Arc<Observations>,
}

impl<F: Fabric> Observed<F> {
    /// Wraps `inner`; what it sees goes to `seen`.
    pub fn new(inner: F, seen: Arc<Observations>) -> Self {
        Self {
            inner,
            epochs: HashMap::new(),
            first_qp: None,
            seen,
        }
    }
}

impl<F: Fabric> Fabric for Observed<F> {
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let qp = self.inner.connect(endpoint, epoch)?;
        self.epochs.insert(qp, epoch);
        self.first_qp.get_or_insert(qp);
        self.seen.connects.fetch_add(1, Ordering::Relaxed);
        Ok(qp)
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        if let Some(&qp_epoch) = self.epochs.get(&qp) {
            let stale = requests
                .iter()
                .filter(|request| request.epoch.is_older_than(qp_epoch))
                .count();
            self.seen
                .stale_posts
                .fetch_add(stale as u64, Ordering::Relaxed);
        }
        self.seen
            .posted
            .fetch_add(requests.len() as u64, Ordering::Relaxed);
        self.inner.post(qp, requests)
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let start = out.len();
        let count = self.inner.poll(out, max);
        for completion in &out[start..] {
            if completion.status != WcStatus::Success {
                self.seen.errors[status_index(completion.status)].fetch_add(1, Ordering::Relaxed);
            }
            if completion.status != WcStatus::Success
                && completion.status != WcStatus::WrFlushErr
                && self.first_qp != Some(completion.qp)
            {
                self.seen.late_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        count
    }

    fn retire(&mut self, qp: QpNum) {
        self.epochs.remove(&qp);
        self.inner.retire(qp);
    }

    fn abandon(&mut self, qp: QpNum) -> bool {
        self.epochs.remove(&qp);
        self.inner.abandon(qp)
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        let event = self.inner.poll_event();
        if event.is_some() {
            self.seen.fatal_events.fetch_add(1, Ordering::Relaxed);
        }
        event
    }

    fn limits(&self) -> FabricLimits {
        self.inner.limits()
    }
}

/// A node's memory: a soft buffer (registered on the first soft rail by allocation) or an
/// anonymous mapping (registered on every libfabric rail).
pub struct NodeBuffer(Memory);

enum Memory {
    Soft(SoftBuffer),
    Host(HostMemory),
}

impl NodeBuffer {
    /// Where it starts.
    pub fn addr(&self) -> u64 {
        match &self.0 {
            Memory::Soft(buffer) => buffer.region().addr,
            Memory::Host(memory) => memory.addr(),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Memory::Soft(buffer) => buffer.len(),
            Memory::Host(memory) => memory.len(),
        }
    }

    /// Whether it is empty (never: nodes allocate at least a byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes.
    ///
    /// # Safety
    /// No transfer may write them while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` live bytes at `addr`, owned by `self`; the caller keeps writers away.
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len()) }
    }

    /// Its bytes, to fill.
    ///
    /// # Safety
    /// No transfer may touch them while the slice lives.
    unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` and the caller exclude every other user.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len()) }
    }
}

/// A registered region of a node: one allocation, registered on every rail.
pub struct NodeRegion {
    /// The node-allocated memory.
    pub buffer: NodeBuffer,
    /// Its registration on each rail.
    pub regions: Vec<MemoryRegion>,
}

/// One rail of a node.
enum NodeRail {
    Soft(SoftDevice),
    Ofi(Arc<OfiRail>, FaultHandle),
}

/// Starts node `name`'s poller of rail `rail` on `fabric`, seen through an [`Observed`]
/// wrapper (what it saw is returned beside the poller); it parks when idle, so that
/// scenarios run on two cores.
fn spawn_poller<F: Fabric + 'static>(
    name: &str,
    rail: usize,
    fabric: F,
    shared: &Arc<ControlShared>,
) -> Result<(Arc<PollerHandle>, Arc<Observations>)> {
    let config = PollerConfig {
        idle: IdleStrategy::SpinThenPark {
            spins: 256,
            park: Duration::from_millis(1),
        },
        ..PollerConfig::new(format!("{name}-rail{rail}"))
    };
    let seen = Arc::new(Observations::default());
    let observed = Observed::new(fabric, seen.clone());
    let poller = PollerHandle::spawn(config, observed, shared.reprepare_hook(rail as u16))
        .context("starting a poller")?;
    Ok((Arc::new(poller), seen))
}

/// One process's worth of railyard: see the module docs.
pub struct Node {
    /// Its segment name.
    pub name: String,
    rails: Vec<NodeRail>,
    /// One poller per rail.
    pub pollers: Vec<Arc<PollerHandle>>,
    /// What each rail's fabric saw.
    pub observations: Vec<Arc<Observations>>,
    /// Its control plane.
    pub control: ControlPlane,
    /// Shared with the control plane and the pollers' hooks.
    pub shared: Arc<ControlShared>,
    /// Its registered regions: private, so that nothing frees their memory while it is
    /// registered ([`Node::regions`] reads them).
    regions: Vec<NodeRegion>,
}

impl Node {
    /// Starts a node with `rails` soft rails listening on `listen`.
    ///
    /// # Errors
    /// When a device, poller or the listener cannot start.
    pub fn start(
        name: &str,
        rails: usize,
        listen: SocketAddr,
        seed: u64,
        policy: Policy,
        incarnation: Option<Incarnation>,
    ) -> Result<Self> {
        Self::start_on(
            &ChaosFabric::Soft,
            name,
            rails,
            listen,
            seed,
            policy,
            incarnation,
        )
    }

    /// [`Self::start`] on `fabric`.
    ///
    /// # Errors
    /// As [`Self::start`]; on libfabric, when the provider cannot open a rail.
    pub fn start_on(
        fabric: &ChaosFabric,
        name: &str,
        rails: usize,
        listen: SocketAddr,
        seed: u64,
        policy: Policy,
        incarnation: Option<Incarnation>,
    ) -> Result<Self> {
        let shared = ControlShared::new(rails);
        let config = ControlConfig {
            listen,
            policy,
            seed,
            incarnation,
            ..ControlConfig::new(name)
        };
        let mut node_rails = Vec::new();
        let mut pollers = Vec::new();
        let mut observations = Vec::new();
        let control = match fabric {
            ChaosFabric::Soft => {
                let mut control_rails = Vec::new();
                for rail in 0..rails {
                    let device =
                        SoftDevice::open(format!("{name}-soft{rail}"), SoftConfig::default())
                            .context("opening a soft device")?;
                    let (poller, seen) = spawn_poller(name, rail, device.fabric(), &shared)?;
                    control_rails.push(ControlRail {
                        fabric: device.clone(),
                        poller: poller.clone(),
                    });
                    node_rails.push(NodeRail::Soft(device));
                    pollers.push(poller);
                    observations.push(seen);
                }
                ControlPlane::start(config, control_rails, shared.clone())
            }
            ChaosFabric::Ofi { provider } => {
                let mut control_rails = Vec::new();
                for rail in 0..rails {
                    let ofi_config = OfiConfig {
                        provider: provider.clone(),
                        domain: None,
                    };
                    let ofi = OfiRail::open(format!("{name}-ofi{rail}"), &ofi_config)
                        .with_context(|| format!("opening a libfabric rail on {provider:?}"))?;
                    let faults = FaultHandle::default();
                    let fabric = Faulted::new(ofi.fabric()?, faults.clone());
                    let (poller, seen) = spawn_poller(name, rail, fabric, &shared)?;
                    control_rails.push(ControlRail {
                        fabric: ofi.clone(),
                        poller: poller.clone(),
                    });
                    node_rails.push(NodeRail::Ofi(ofi, faults));
                    pollers.push(poller);
                    observations.push(seen);
                }
                ControlPlane::start(config, control_rails, shared.clone())
            }
        }
        .with_context(|| format!("starting the control plane of {name}"))?;
        Ok(Self {
            name: name.to_string(),
            rails: node_rails,
            pollers,
            observations,
            control,
            shared,
            regions: Vec::new(),
        })
    }

    /// Where its handshake listener is.
    pub fn addr(&self) -> SocketAddr {
        self.control.local_addr()
    }

    /// Allocates `len` bytes registered on every rail and publishes them; returns its index.
    ///
    /// # Errors
    /// When memory cannot be allocated or registered.
    pub fn alloc(&mut self, len: usize) -> Result<usize> {
        let buffer = match &self.rails[0] {
            NodeRail::Soft(device) => Memory::Soft(device.alloc(len, Access::ALL)?),
            NodeRail::Ofi(..) => Memory::Host(HostMemory::new(len)?),
        };
        let region = self.register_everywhere(NodeBuffer(buffer))?;
        self.regions.push(region);
        self.publish();
        Ok(self.regions.len() - 1)
    }

    /// Its registered regions, in the order [`Self::alloc`] made them.
    pub fn regions(&self) -> &[NodeRegion] {
        &self.regions
    }

    /// The bytes of region `index`, to fill.
    ///
    /// # Safety
    /// No transfer may touch them while the slice lives.
    ///
    /// # Panics
    /// When there is no region `index`.
    pub unsafe fn bytes_mut(&mut self, index: usize) -> &mut [u8] {
        // SAFETY: the caller keeps transfers away.
        unsafe { self.regions[index].buffer.as_mut_slice() }
    }

    /// Registers `buffer` on every rail (a soft buffer is registered on the first by its
    /// allocation); on a failure, withdraws what it registered (and keeps the memory if that
    /// fails too).
    fn register_everywhere(&self, buffer: NodeBuffer) -> Result<NodeRegion> {
        let mut regions = Vec::new();
        if let Memory::Soft(soft) = &buffer.0 {
            regions.push(soft.region());
        }
        let first = regions.len();
        if let Err(error) = self.register_on_rails(&buffer, first, &mut regions) {
            let mut withdrawn = true;
            for (rail, region) in self.rails[first..].iter().zip(&regions[first..]) {
                withdrawn &= deregister(rail, region);
            }
            if !withdrawn {
                std::mem::forget(buffer);
            }
            return Err(error);
        }
        Ok(NodeRegion { buffer, regions })
    }

    /// Registers `buffer` on the rails from `first` on, into `regions`.
    fn register_on_rails(
        &self,
        buffer: &NodeBuffer,
        first: usize,
        regions: &mut Vec<MemoryRegion>,
    ) -> Result<()> {
        let (addr, len) = (buffer.addr(), buffer.len());
        for rail in &self.rails[first..] {
            // The memory outlives these registrations: `Drop` of the node deregisters before
            // it can go.
            let region = match rail {
                NodeRail::Soft(device) => {
                    // SAFETY: `len` bytes of the node's memory at `addr` (see above).
                    unsafe { device.register(addr as *mut u8, len, Access::ALL) }?
                }
                NodeRail::Ofi(ofi, _) => {
                    // SAFETY: as above.
                    unsafe { ofi.register(addr, len as u64, Access::ALL) }?
                }
            };
            regions.push(region);
        }
        Ok(())
    }

    fn publish(&self) {
        self.shared.set_regions(
            self.regions
                .iter()
                .map(|region| RegionDescriptor {
                    base: region.buffer.addr(),
                    len: region.buffer.len() as u64,
                    rkeys: region.regions.iter().map(|r| r.rkey).collect(),
                    // Registered once, never again: one generation.
                    generation: 1,
                    access: Access::ALL,
                })
                .collect(),
        );
    }

    /// The fault plan of rail `rail`.
    pub fn faults(&self, rail: usize) -> FaultHandle {
        match &self.rails[rail] {
            NodeRail::Soft(device) => device.faults(),
            NodeRail::Ofi(_, faults) => faults.clone(),
        }
    }

    /// Stale posts seen on all rails.
    pub fn stale_posts(&self) -> u64 {
        self.observations
            .iter()
            .map(|o| o.stale_posts.load(Ordering::Relaxed))
            .sum()
    }

    /// Non-flush error completions on queue pairs after each rail's first.
    pub fn late_errors(&self) -> u64 {
        self.observations
            .iter()
            .map(|o| o.late_errors.load(Ordering::Relaxed))
            .sum()
    }

    /// Queue pairs that raised QP fatal, on all rails.
    pub fn fatal_events(&self) -> u64 {
        self.observations
            .iter()
            .map(|o| o.fatal_events.load(Ordering::Relaxed))
            .sum()
    }

    /// Error completions with `status` on all rails.
    pub fn errors(&self, status: WcStatus) -> u64 {
        self.observations
            .iter()
            .map(|o| o.errors[status_index(status)].load(Ordering::Relaxed))
            .sum()
    }

    /// Stops the control plane, then the pollers (every slice resolves).
    pub fn stop(&self) {
        self.control.shutdown();
        for poller in &self.pollers {
            poller.shutdown();
        }
    }
}

/// Withdraws `region` from `rail`; a failure is logged (and the memory must then be kept).
fn deregister(rail: &NodeRail, region: &MemoryRegion) -> bool {
    let outcome = match rail {
        NodeRail::Soft(device) => device.deregister(region).map_err(|e| e.to_string()),
        NodeRail::Ofi(ofi, _) => ofi.deregister(region).map_err(|e| e.to_string()),
    };
    if let Err(reason) = &outcome {
        tracing::warn!(target: "railyard::chaos", lkey = region.lkey, %reason, "cannot deregister a node's region; its memory is kept");
    }
    outcome.is_ok()
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
        // Work a poller gave up on (resolved past its flush grace) may still be in a
        // provider's hands, reading or writing this memory: then none of it is freed.
        if self
            .pollers
            .iter()
            .any(|poller| poller.counters().unflushed > 0)
        {
            std::mem::forget(std::mem::take(&mut self.regions));
            return;
        }
        // Registrations go before the memory does (a soft buffer's own, on the first rail,
        // goes with it); memory whose registration could not be withdrawn is never freed.
        for region in std::mem::take(&mut self.regions) {
            let mut withdrawn = true;
            for (rail, registered) in self.rails.iter().zip(&region.regions) {
                let own = matches!((rail, &region.buffer.0), (NodeRail::Soft(_), Memory::Soft(soft)) if soft.region() == *registered);
                if !own {
                    withdrawn &= deregister(rail, registered);
                }
            }
            if !withdrawn {
                std::mem::forget(region);
            }
        }
    }
}
