//! Transfers: what the application asks for, and how a submitter turns it into slices.
//!
//! Preparing a submission checks everything first — each local range inside its registered
//! region, each remote range inside one region of the peer's current descriptor — and
//! queues nothing when anything is wrong. Then each transfer is split at the engine's slice
//! size and its slices are striped round-robin over the rails whose endpoint to the peer
//! has a queue pair, each stamped with that rail's keys and the endpoint's current epoch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use railyard_control::Incarnation;
use railyard_dataplane::fabric::{MemoryRegion, Opcode};
use railyard_dataplane::{Batch, EndpointId, Epoch, SliceSpec, Submitter};

use super::{Engine, Peer, PeerStats, Region, TransferError};

/// The direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Local range → remote range.
    Write,
    /// Remote range → local range.
    Read,
}

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

/// What an engine counts per peer.
#[derive(Debug, Default)]
pub(crate) struct PeerCounters {
    name: Mutex<String>,
    requests: AtomicU64,
    slices: AtomicU64,
    bytes: AtomicU64,
}

pub(crate) type PeerTable = Mutex<HashMap<Incarnation, Arc<PeerCounters>>>;

pub(crate) fn peer_stats(engine: &Engine) -> Vec<PeerStats> {
    let table = engine
        .inner
        .peers
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let mut stats: Vec<PeerStats> = table
        .iter()
        .map(|(incarnation, counters)| PeerStats {
            name: counters
                .name
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            incarnation: *incarnation,
            requests: counters.requests.load(Ordering::Relaxed),
            slices: counters.slices.load(Ordering::Relaxed),
            bytes: counters.bytes.load(Ordering::Relaxed),
        })
        .collect();
    stats.sort_by(|a, b| a.name.cmp(&b.name));
    stats
}

/// One thread's way to submit transfers. `Send`, not `Sync`.
pub struct EngineSubmitter {
    engine: Engine,
    submitter: Submitter,
    specs: Vec<SliceSpec>,
    next_rail: usize,
    timing: SubmitTiming,
    /// The last region looked up, to spare the lock for runs of transfers from one region.
    last_region: Option<(Region, Vec<MemoryRegion>)>,
    /// Scratch: the rails connected to the peer of the submission being prepared (rail,
    /// endpoint, remote rail, epoch).
    connected: Vec<(usize, EndpointId, u16, Epoch)>,
    /// Counters of the peers this submitter has submitted to.
    counters: HashMap<Incarnation, Arc<PeerCounters>>,
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
            connected: Vec::new(),
            counters: HashMap::new(),
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
        self.prepare(peer, transfers)?;
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
        counters
            .requests
            .fetch_add(transfers.len() as u64, Ordering::Relaxed);
        counters
            .slices
            .fetch_add(self.specs.len() as u64, Ordering::Relaxed);
        counters.bytes.fetch_add(
            transfers.iter().map(|t| t.len).sum::<u64>(),
            Ordering::Relaxed,
        );
    }

    /// Validates every transfer and fills `specs`. Allocates nothing in steady state: the
    /// rails, the last region's keys and the specs live in the submitter between calls.
    fn prepare(&mut self, peer: &Peer, transfers: &[Transfer]) -> Result<(), TransferError> {
        let Self {
            engine,
            specs,
            next_rail,
            last_region,
            connected,
            ..
        } = self;
        specs.clear();
        *last_region = None;
        let descriptor = peer.descriptor();
        connected.clear();
        connected.extend(peer.views().iter().enumerate().filter_map(|(rail, view)| {
            view.epoch()
                .map(|epoch| (rail, view.id, view.key.remote_rail, epoch))
        }));
        if connected.is_empty() {
            return Err(TransferError::NotConnected {
                peer: peer.name().to_string(),
            });
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
            let mut offset = 0;
            while offset < transfer.len {
                let len = slice_size.min(transfer.len - offset);
                let (rail, endpoint, remote_rail, epoch) = connected[*next_rail % connected.len()];
                *next_rail = next_rail.wrapping_add(1);
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
                });
                offset += len;
            }
        }
        Ok(())
    }
}
