//! Transfers: what the application asks for, and how a submitter turns it into slices.
//!
//! Preparing a submission checks everything first — each local range inside its registered
//! region, each remote range inside one region of the peer's current descriptor — and
//! queues nothing when anything is wrong. Then each transfer is split at the engine's slice
//! size and each slice goes to a rail ([`RailOption`], [`eligible`], [`least_loaded`]): of
//! the rails whose endpoint to the peer is up (all that have a queue pair, if none is up),
//! the one with the fewest bytes queued or in flight — its poller's load plus what this
//! submission gave it already — a rail on another NUMA node than the local memory counting
//! [`REMOTE_NODE_PENALTY`] more, so local rails go first and remote ones take the
//! overflow. Each slice is stamped with that rail's keys and the endpoint's current epoch.
//! A remote range the descriptor lacks makes the submitter fetch it once more (up to
//! [`REFRESH_WAIT`]); the submitter's [`RegionIndex`] finds the local region of a raw
//! address, for the sessions above (`session.rs`), which use this module and never the
//! other way round.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use railyard_control::{EndpointView, Incarnation, SegmentDescriptor};
use railyard_dataplane::fabric::{MemoryRegion, Opcode};
use railyard_dataplane::{Batch, EndpointId, Epoch, SliceSpec, Submitter};

use super::error::TransferError;
use super::op::Op;
use super::peer::Peer;
use super::region::Region;
use super::state::Engine;
use super::stats::PeerCounters;

/// Longest a submission waits for a peer's descriptor to be fetched again when it names a
/// remote range the descriptor does not hold (a region the peer registered since).
pub const REFRESH_WAIT: Duration = Duration::from_secs(1);

/// How often a refresh looks whether the new descriptor has arrived.
const REFRESH_POLL: Duration = Duration::from_micros(200);

/// One transfer: a local range of a registered region and a remote range of the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Which way.
    pub op: Op,
    /// The local region.
    pub local: Region,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Remote start address (inside one region of the peer's descriptor).
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
}

/// Where the last submission's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubmitTiming {
    /// Validating and splitting into slices.
    pub prepare: Duration,
    /// Handing the slices to the pollers.
    pub post: Duration,
}

/// What the last prepared submission posted ([`EngineSubmitter::last_prepared`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PreparedTotals {
    /// Descriptor pairs given.
    pub pairs: usize,
    /// Runs they became once contiguous pairs merged (each split at the slice size).
    pub runs: usize,
    /// Slices posted.
    pub slices: usize,
    /// Bytes.
    pub bytes: u64,
}

/// One thread's way to submit transfers. `Send`, not `Sync`.
pub struct EngineSubmitter {
    pub(crate) engine: Engine,
    pub(crate) submitter: Submitter,
    pub(crate) specs: Vec<SliceSpec>,
    pub(crate) next_rail: usize,
    pub(crate) timing: SubmitTiming,
    /// The last region looked up, while the engine's regions stay as they were (their
    /// version): no lock for transfers from a region it has seen.
    last_region: Option<(Region, Vec<MemoryRegion>)>,
    /// The regions' version `last_region` was looked up at.
    regions_version: u64,
    /// The last peer's descriptor: its first endpoint (held, so that it is never another
    /// peer's at the same address), the sum of its endpoints' descriptor versions, and
    /// the descriptor. Kept while the versions stay: no lock per submission.
    last_descriptor: Option<(Arc<EndpointView>, u64, Arc<SegmentDescriptor>)>,
    /// Scratch: the rails connected to the peer of the submission being prepared.
    pub(crate) connected: Vec<RailOption>,
    /// Scratch: the indices of `connected` a transfer's slices may go to.
    pub(crate) chosen: Vec<usize>,
    /// What the last prepared submission posted ([`Self::last_prepared`]).
    pub(crate) prepared_totals: PreparedTotals,
    /// Counters of the peers this submitter has submitted to.
    counters: HashMap<Incarnation, Arc<PeerCounters>>,
    /// Its index of the local regions, for transfers named by raw addresses.
    pub(crate) region_index: RegionIndex,
    /// Scratch: raw transfers resolved to regions.
    pub(crate) resolved: Vec<Transfer>,
}

impl std::fmt::Debug for EngineSubmitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSubmitter")
            .field("engine", &self.engine)
            .finish()
    }
}

/// Slots of each submission ring.
const RING_CAPACITY: usize = 4096;

impl EngineSubmitter {
    pub(crate) fn new(engine: Engine) -> Result<Self, TransferError> {
        let pollers: Vec<_> = engine.pollers().iter().map(|p| &**p).collect();
        let submitter = Submitter::new(&pollers, RING_CAPACITY)
            .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        Ok(Self {
            engine,
            submitter,
            specs: Vec::new(),
            next_rail: 0,
            timing: SubmitTiming::default(),
            last_region: None,
            regions_version: 0,
            last_descriptor: None,
            connected: Vec::new(),
            chosen: Vec::new(),
            prepared_totals: PreparedTotals::default(),
            counters: HashMap::new(),
            region_index: RegionIndex::default(),
            resolved: Vec::new(),
        })
    }

    /// Where the last submission's time went.
    pub fn last_timing(&self) -> SubmitTiming {
        self.timing
    }

    /// Submits `transfers` to `peer` as one batch (request `i` is transfer `i`) with the
    /// engine's default deadline.
    ///
    /// # Errors
    /// [`TransferError`] naming the first bad transfer; nothing is queued.
    pub fn submit(&mut self, peer: &Peer, transfers: &[Transfer]) -> Result<Batch, TransferError> {
        let deadline = Instant::now() + self.engine.default_deadline();
        self.submit_by(peer, transfers, deadline)
    }

    /// [`Self::submit`], then sends `notification` to the peer once the batch has completed
    /// successfully: the peer sees it only after all of the batch's data (and never if the
    /// batch fails).
    ///
    /// # Errors
    /// As [`Self::submit`]; [`TransferError::NotificationTooLarge`] (nothing submitted)
    /// beyond [`MAX_NOTIFY`](railyard_control::wire::MAX_NOTIFY) bytes.
    pub fn submit_and_notify(
        &mut self,
        peer: &Peer,
        transfers: &[Transfer],
        notification: Vec<u8>,
    ) -> Result<Batch, TransferError> {
        let max = railyard_control::wire::MAX_NOTIFY;
        if notification.len() > max {
            return Err(TransferError::NotificationTooLarge {
                len: notification.len(),
                max,
            });
        }
        let batch = self.submit(peer, transfers)?;
        self.engine
            .notify_after(peer, notification, &batch)
            .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        Ok(batch)
    }

    /// [`Self::submit`], then, once the batch has completed successfully, sends `value` to
    /// the peer as the immediate of a zero-length RDMA WRITE_WITH_IMM on one of its rails:
    /// the peer's [`Engine::drain_notifications`] yields it as
    /// [`NotificationBody::Immediate`] after all of the batch's data (on every rail) is in
    /// place, and never if the batch fails. Unlike [`Self::submit_and_notify`] it takes
    /// no trip through the control connection.
    ///
    /// [`NotificationBody::Immediate`]: railyard_control::NotificationBody::Immediate
    ///
    /// # Errors
    /// As [`Self::submit`].
    pub fn submit_and_signal(
        &mut self,
        peer: &Peer,
        transfers: &[Transfer],
        value: u32,
    ) -> Result<Batch, TransferError> {
        let batch = self.submit(peer, transfers)?;
        self.engine
            .signal_after(peer, value, &batch)
            .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        Ok(batch)
    }

    /// [`Self::submit`] with an explicit deadline.
    ///
    /// # Errors
    /// As [`Self::submit`].
    pub fn submit_by(
        &mut self,
        peer: &Peer,
        transfers: &[Transfer],
        deadline: Instant,
    ) -> Result<Batch, TransferError> {
        let started = Instant::now();
        if let Err(error) = self.prepare(peer, transfers) {
            // A remote range the descriptor does not hold may be a region the peer
            // registered since: fetch the descriptor once more, then judge again.
            if !matches!(error, TransferError::RemoteRange { .. })
                || !self
                    .engine
                    .refresh_descriptor(peer, deadline.min(started + REFRESH_WAIT))
            {
                return Err(error);
            }
            self.prepare(peer, transfers)?;
        }
        let prepared = Instant::now();
        let batch = self
            .submitter
            .submit(transfers.len(), &self.specs, deadline)
            .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        self.timing = SubmitTiming {
            prepare: prepared - started,
            post: prepared.elapsed(),
        };
        self.count(peer, transfers);
        Ok(batch)
    }

    fn count(&mut self, peer: &Peer, transfers: &[Transfer]) {
        let mut requests = [0u64; 2];
        let mut bytes = [0u64; 2];
        for transfer in transfers {
            requests[transfer.op.index()] += 1;
            bytes[transfer.op.index()] += transfer.len;
        }
        self.count_totals(peer, requests, bytes);
    }

    /// Adds a submission's requests and bytes per op (in [`Op::index`] order) and its
    /// slices to `peer`'s counters.
    pub(crate) fn count_totals(&mut self, peer: &Peer, requests: [u64; 2], bytes: [u64; 2]) {
        let engine = &self.engine;
        let counters = self.counters.entry(peer.incarnation()).or_insert_with(|| {
            let mut table = engine
                .inner
                .peers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            table
                .entry(peer.incarnation())
                .or_insert_with(|| {
                    let counters = PeerCounters::default();
                    *counters.name.lock().unwrap_or_else(PoisonError::into_inner) =
                        peer.name().to_string();
                    Arc::new(counters)
                })
                .clone()
        });
        for op in Op::ALL.map(Op::index) {
            if requests[op] > 0 {
                counters.requests[op].fetch_add(requests[op], Ordering::Relaxed);
                counters.bytes[op].fetch_add(bytes[op], Ordering::Relaxed);
            }
        }
        counters
            .slices
            .fetch_add(self.specs.len() as u64, Ordering::Relaxed);
    }

    /// `peer`'s descriptor, from the last one kept while its endpoints' descriptor versions
    /// stay.
    fn descriptor_of(&mut self, peer: &Peer) -> Arc<SegmentDescriptor> {
        let versions: u64 = peer
            .views()
            .iter()
            .map(|view| view.descriptor_version())
            .sum();
        if let (Some((first, kept, descriptor)), Some(view)) =
            (&self.last_descriptor, peer.views().first())
        {
            if Arc::ptr_eq(first, view) && *kept == versions {
                return descriptor.clone();
            }
        }
        let descriptor = peer.descriptor();
        self.last_descriptor = peer
            .views()
            .first()
            .map(|view| (view.clone(), versions, descriptor.clone()));
        descriptor
    }

    /// Fills `connected` with the rails that have a queue pair to `peer`, with their
    /// endpoints' current epochs and their pollers' loads.
    ///
    /// # Errors
    /// [`TransferError::NotConnected`] when none has.
    pub(crate) fn connected_rails(&mut self, peer: &Peer) -> Result<(), TransferError> {
        let Self {
            engine, connected, ..
        } = self;
        connected.clear();
        let pollers = engine.pollers();
        let numa = &engine.inner.rail_numa;
        connected.extend(peer.views().iter().enumerate().filter_map(|(rail, view)| {
            Some(RailOption {
                rail,
                endpoint: view.id,
                remote_rail: view.key.remote_rail,
                epoch: view.epoch()?,
                up: view.phase() == railyard_control::Phase::Ready,
                on_probation: view.on_probation(),
                numa: numa.get(rail).copied(),
                load: pollers.get(rail).map_or(0, |poller| poller.load_bytes()),
            })
        }));
        if connected.is_empty() {
            return Err(TransferError::NotConnected {
                peer: peer.name().to_string(),
            });
        }
        Ok(())
    }

    /// Validates every transfer and fills `specs`. Allocates nothing in steady state: the
    /// rails, the last region's keys and the specs live in the submitter between calls.
    fn prepare(&mut self, peer: &Peer, transfers: &[Transfer]) -> Result<(), TransferError> {
        let descriptor = self.descriptor_of(peer);
        self.connected_rails(peer)?;
        let Self {
            engine,
            specs,
            next_rail,
            last_region,
            regions_version,
            connected,
            chosen,
            ..
        } = self;
        specs.clear();
        let version = engine.regions_version();
        if *regions_version != version {
            *last_region = None;
            *regions_version = version;
        }
        let slice_size = engine.slice_size() as u64;
        for (index, transfer) in transfers.iter().enumerate() {
            if transfer.len == 0 {
                return Err(TransferError::Empty { transfer: index });
            }
            if last_region
                .as_ref()
                .is_none_or(|(region, _)| region.id != transfer.local.id)
            {
                *last_region = Some(engine.registrations(transfer.local.id).ok_or(
                    TransferError::UnknownRegion {
                        transfer: index,
                        region: transfer.local.id,
                    },
                )?);
            }
            let Some((region, registrations)) = last_region.as_ref() else {
                continue;
            };
            if transfer
                .local_offset
                .checked_add(transfer.len)
                .is_none_or(|end| end > region.len)
            {
                return Err(TransferError::LocalRange {
                    transfer: index,
                    region: region.id,
                    offset: transfer.local_offset,
                    len: transfer.len,
                    region_len: region.len,
                });
            }
            let remote_range = || TransferError::RemoteRange {
                transfer: index,
                peer: peer.name().to_string(),
                addr: transfer.remote_addr,
                len: transfer.len,
            };
            let remote = descriptor
                .region_for(transfer.remote_addr, transfer.len)
                .ok_or_else(remote_range)?;
            let opcode = match transfer.op {
                Op::Write => Opcode::Write,
                Op::Read => Opcode::Read,
            };
            eligible(connected, chosen);
            let mut offset = 0;
            while offset < transfer.len {
                let len = slice_size.min(transfer.len - offset);
                let pick = least_loaded(connected, chosen, *next_rail, region.numa);
                *next_rail = next_rail.wrapping_add(1);
                connected[pick].load += len;
                let RailOption {
                    rail,
                    endpoint,
                    remote_rail,
                    epoch,
                    ..
                } = connected[pick];
                let rkey = *remote
                    .rkeys
                    .get(usize::from(remote_rail))
                    .ok_or_else(remote_range)?;
                specs.push(SliceSpec {
                    rail,
                    request: index as u32,
                    opcode,
                    local_addr: region.addr + transfer.local_offset + offset,
                    lkey: registrations[rail].lkey,
                    remote_addr: transfer.remote_addr + offset,
                    rkey,
                    len: len as u32,
                    imm: 0,
                    endpoint,
                    epoch,
                    // The low bits: a 32-bit wrap of one region's generations is 4 billion
                    // registrations away.
                    generation: remote.generation as u32,
                });
                offset += len;
            }
        }
        Ok(())
    }
}

/// A rail a submission's slices may go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RailOption {
    /// The local rail.
    pub(crate) rail: usize,
    /// Its endpoint to the peer.
    pub(crate) endpoint: EndpointId,
    /// The peer's rail it is connected to.
    pub(crate) remote_rail: u16,
    /// The endpoint's current epoch.
    pub(crate) epoch: Epoch,
    /// Its endpoint has a working queue pair (not reconnecting, not failing fast).
    pub(crate) up: bool,
    /// Its circuit is half-open: the queue pair after a cooldown has not yet carried a
    /// success (the link may still be dead).
    pub(crate) on_probation: bool,
    /// The rail's NUMA node, if known.
    pub(crate) numa: Option<u32>,
    /// Bytes its poller holds, plus what this submission gave it so far.
    pub(crate) load: u64,
}

/// How many more bytes a rail on another NUMA node than the memory must have free before
/// it takes a slice: local rails first, remote ones once the local ones are this far behind.
pub(crate) const REMOTE_NODE_PENALTY: u64 = 4 << 20;

/// The same for a rail whose circuit is half-open: it takes work only as overflow (or when
/// it is the only rail up), so that a link still dead after its cooldown fails little while
/// another rail works; its first success closes the circuit for good.
pub(crate) const PROBATION_PENALTY: u64 = 256 << 20;

/// Fills `chosen` with the indices of `options` a transfer may use: the rails that are up
/// (every one, when none is: the poller holds or fails the work as the endpoint's state
/// says).
pub(crate) fn eligible(options: &[RailOption], chosen: &mut Vec<usize>) {
    chosen.clear();
    let any_up = options.iter().any(|option| option.up);
    chosen.extend((0..options.len()).filter(|&i| options[i].up || !any_up));
}

/// The index (into `options`) of the `chosen` rail with the least load, a rail off
/// `local_numa` (the memory's node, if known) counting [`REMOTE_NODE_PENALTY`] more and a
/// rail on probation [`PROBATION_PENALTY`] more; ties go round-robin from `turn`.
pub(crate) fn least_loaded(
    options: &[RailOption],
    chosen: &[usize],
    turn: usize,
    local_numa: Option<u32>,
) -> usize {
    let cost = |option: &RailOption| {
        let remote = local_numa.is_some_and(|node| option.numa.is_some_and(|n| n != node));
        option.load
            + if remote { REMOTE_NODE_PENALTY } else { 0 }
            + if option.on_probation {
                PROBATION_PENALTY
            } else {
                0
            }
    };
    let count = chosen.len().max(1);
    (0..count)
        .map(|step| chosen.get((turn + step) % count).copied().unwrap_or(0))
        .min_by_key(|&i| options.get(i).map_or(u64::MAX, cost))
        .unwrap_or(0)
}

impl Engine {
    /// A submitter for this thread.
    ///
    /// # Errors
    /// [`TransferError::PollerStopped`] when a rail's poller has stopped.
    pub fn submitter(&self) -> Result<EngineSubmitter, TransferError> {
        EngineSubmitter::new(self.clone())
    }

    /// Asks `peer` for its descriptor again and waits (until `deadline`) for it to arrive:
    /// true when a new one did.
    pub fn refresh_descriptor(&self, peer: &Peer, deadline: Instant) -> bool {
        let versions = |peer: &Peer| -> u64 {
            peer.views()
                .iter()
                .map(|view| view.descriptor_version())
                .sum()
        };
        let before = versions(peer);
        if self
            .inner
            .control
            .refresh_descriptor(peer.addr(), peer.incarnation())
            .is_err()
        {
            return false;
        }
        while Instant::now() < deadline {
            if versions(peer) != before {
                return true;
            }
            std::thread::sleep(REFRESH_POLL);
        }
        false
    }
}

/// The local regions of a submitter, sorted by address, and the engine's regions version
/// they were read at.
#[derive(Debug, Default)]
pub(crate) struct RegionIndex {
    version: Option<u64>,
    regions: Vec<Region>,
}

impl RegionIndex {
    /// The region holding `addr..addr + len`, reading the engine's regions again only when
    /// they changed since the last look.
    pub(super) fn find(&mut self, engine: &Engine, addr: u64, len: u64) -> Option<Region> {
        let version = engine.regions_version();
        if self.version != Some(version) {
            self.regions = engine.regions();
            self.version = Some(version);
        }
        // Regions do not overlap (registration refuses it): the one starting last at or
        // before `addr` is the only candidate.
        let after = self.regions.partition_point(|region| region.addr <= addr);
        let candidate = self.regions.get(after.checked_sub(1)?)?;
        candidate.contains(addr, len).then_some(*candidate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(rail: usize, up: bool, numa: u32, load: u64) -> RailOption {
        RailOption {
            rail,
            endpoint: EndpointId(rail as u32),
            remote_rail: 0,
            epoch: Epoch::FIRST,
            up,
            on_probation: false,
            numa: Some(numa),
            load,
        }
    }

    /// Slices of `bytes` each, `count` of them, from memory on `numa`: how many each rail
    /// gets.
    fn spread(options: &mut [RailOption], numa: Option<u32>, count: usize) -> Vec<usize> {
        let mut chosen = Vec::new();
        eligible(options, &mut chosen);
        let mut per_rail = vec![0; options.len()];
        for turn in 0..count {
            let pick = least_loaded(options, &chosen, turn, numa);
            options[pick].load += 1 << 18;
            per_rail[options[pick].rail] += 1;
        }
        per_rail
    }

    #[test]
    fn a_rail_that_is_down_gets_nothing_while_another_is_up() {
        let mut options = [option(0, false, 0, 0), option(1, true, 0, 0)];
        assert_eq!(spread(&mut options, None, 8), vec![0, 8]);
        // None up: the work goes where the queue pairs are, to wait or fail fast there.
        let mut options = [option(0, false, 0, 0), option(1, false, 0, 0)];
        assert_eq!(spread(&mut options, None, 8), vec![4, 4]);
    }

    #[test]
    fn numa_local_rails_first_and_the_least_loaded_of_them() {
        let mut options = [
            option(0, true, 0, 0),
            option(1, true, 1, 0),
            option(2, true, 1, 1 << 20),
            option(3, true, 0, 0),
        ];
        // Node 1: rails 1 and 2 only; rail 2 starts 1 MiB behind, so rail 1 takes the
        // first four 256 KiB slices before they alternate.
        assert_eq!(spread(&mut options, Some(1), 8), vec![0, 6, 2, 0]);
        // A node no rail is on, or memory of no known node: every rail, by load.
        let mut options = [option(0, true, 0, 0), option(1, true, 1, 0)];
        assert_eq!(spread(&mut options, Some(7), 6), vec![3, 3]);
    }

    #[test]
    fn remote_rails_take_work_once_the_local_ones_are_far_enough_behind() {
        // The local rail already holds 6 MiB, the remote one nothing: the remote one takes
        // slices until it is within the penalty of the local one, then they alternate.
        let mut options = [option(0, true, 0, 6 << 20), option(1, true, 1, 0)];
        let per_rail = spread(&mut options, Some(0), 16);
        assert_eq!(per_rail, vec![4, 12]);
    }

    #[test]
    fn a_rail_on_probation_takes_work_only_as_overflow_or_alone() {
        let mut options = [option(0, true, 0, 0), option(1, true, 0, 0)];
        options[1].on_probation = true;
        assert_eq!(spread(&mut options, Some(0), 8), vec![8, 0]);
        // Alone (the other is down), it carries the work: its first success closes it.
        let mut options = [option(0, false, 0, 0), option(1, true, 0, 0)];
        options[1].on_probation = true;
        assert_eq!(spread(&mut options, Some(0), 8), vec![0, 8]);
    }

    #[test]
    fn a_local_rail_that_is_down_does_not_keep_work_off_the_remote_ones() {
        let mut options = [option(0, false, 0, 0), option(1, true, 1, 0)];
        assert_eq!(spread(&mut options, Some(0), 4), vec![0, 4]);
    }

    /// The production fixture (two sockets, twelve NICs): memory on either node goes only
    /// to that node's rails, spread evenly over them.
    #[test]
    fn on_the_production_plan_memory_stays_on_its_nodes_rails() {
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/topology/hicache-12nic.xml"
        );
        let topology =
            railyard_topology::HostTopology::from_xml_file(std::path::Path::new(fixture))
                .expect("the fixture loads");
        let plan = topology
            .plan(&railyard_topology::PlanOptions::default())
            .expect("a plan");
        let nodes: Vec<u32> = plan.rails.iter().map(|rail| rail.numa_node).collect();
        let distinct: std::collections::BTreeSet<u32> = nodes.iter().copied().collect();
        assert!(distinct.len() >= 2, "a two-node plan: {nodes:?}");
        for node in distinct {
            let mut options: Vec<RailOption> = nodes
                .iter()
                .enumerate()
                .map(|(rail, &numa)| option(rail, true, numa, 0))
                .collect();
            let local = nodes.iter().filter(|&&n| n == node).count();
            let per_rail = spread(&mut options, Some(node), 12 * local);
            for (rail, &count) in per_rail.iter().enumerate() {
                let expected = if nodes[rail] == node { 12 } else { 0 };
                assert_eq!(
                    count, expected,
                    "rail {rail} (node {}), memory on node {node}",
                    nodes[rail]
                );
            }
        }
    }
}
