//! Prepared descriptor lists: ranges resolved to their regions and keys once
//! ([`Engine::prepare_local`], [`Peer::prepare`]), then posted by index as often as the
//! caller likes ([`EngineSubmitter::submit_prepared`]) with no per-descriptor lookup — the
//! shape NIXL's `prep_xfer_dlist` / `make_prepped_xfer` give inference servers.
//!
//! A list owns copies of what it resolved: each descriptor's range and the index of its
//! region in the list's own small region table (local: the region's id, NUMA node and local
//! key per rail; remote: the region's base, length, generation and rkey per remote rail).
//! Posting checks the table, not the descriptors: a local list against the engine's
//! regions version (a region deregistered or registered anew since — a new id — makes it
//! stale), a remote list against its peer's descriptor versions (a region gone or of a new
//! generation makes it stale; new keys for the same generation are taken in) and against
//! the fences the peer put up (a revoke since it was prepared fences it for good). Each
//! check costs nothing while nothing changed. Slices carry the epoch current at posting
//! and the generation the list holds, so the poller's epoch rule re-prepares them across
//! reconnects as it does any slice, and never into memory of another generation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use railyard_control::Incarnation;
use railyard_dataplane::fabric::Opcode;
use railyard_dataplane::{Batch, SliceSpec};

use super::error::{PrepareError, TransferError};
use super::op::Op;
use super::peer::Peer;
use super::state::Engine;
use super::transfer::{EngineSubmitter, PreparedTotals, SubmitTiming, eligible, least_loaded};

/// One descriptor of a list: a range and its region in the list's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    addr: u64,
    len: u64,
    region: u32,
}

/// A local region as a list resolved it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LocalRegion {
    id: u64,
    numa: Option<u32>,
    /// Its local key on each rail.
    lkeys: Vec<u32>,
}

/// Local ranges resolved to their registered regions once ([`Engine::prepare_local`]), for
/// [`EngineSubmitter::submit_prepared`]. Posting checks it against the engine's regions only
/// when they changed: a region it names deregistered or registered anew (a new id) makes
/// it stale. `Send + Sync`; share it behind an `Arc` between threads.
#[derive(Debug)]
pub struct LocalList {
    engine: Incarnation,
    entries: Vec<Entry>,
    regions: Vec<LocalRegion>,
    /// The engine's regions version its regions were last seen registered at.
    checked_at: AtomicU64,
}

impl LocalList {
    /// How many descriptors it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Descriptor `index` as `(addr, len)`.
    pub fn get(&self, index: usize) -> Option<(u64, u64)> {
        self.entries.get(index).map(|entry| (entry.addr, entry.len))
    }

    /// Fails when a region it names is no longer registered as it was (deregistered, or
    /// registered anew under a new id); checks only when the engine's regions changed since
    /// the last look.
    fn check(&self, engine: &Engine) -> Result<(), TransferError> {
        if self.engine != engine.incarnation() {
            return Err(TransferError::ForeignList {
                side: "local",
                engine: engine.name().to_string(),
            });
        }
        let version = engine.regions_version();
        if self.checked_at.load(Ordering::Acquire) == version {
            return Ok(());
        }
        for region in &self.regions {
            if engine.registrations(region.id).is_none() {
                return Err(TransferError::StaleList {
                    side: "local",
                    reason: format!(
                        "its region {} was deregistered or registered anew since it was \
                         prepared; prepare the list again",
                        region.id
                    ),
                });
            }
        }
        self.checked_at.store(version, Ordering::Release);
        Ok(())
    }
}

/// A remote region as a list resolved it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RemoteRegion {
    base: u64,
    len: u64,
    generation: u64,
    /// Its rkey on each of the peer's rails.
    rkeys: Vec<u32>,
}

/// What a remote list last saw of its peer's descriptors.
#[derive(Debug)]
struct RemoteState {
    /// The sum of the peer's endpoints' descriptor versions.
    versions: u64,
    regions: Arc<[RemoteRegion]>,
}

/// Remote ranges of one peer resolved to its regions and keys once ([`Peer::prepare`]), for
/// [`EngineSubmitter::submit_prepared`]. Posting checks it against the peer's descriptor only
/// when it changed (a region gone or of a new generation makes it stale; new keys for the
/// same generation are taken in) and against the peer's fences (a revoke since makes it
/// stale for good). `Send + Sync`; share it behind an `Arc` between threads.
#[derive(Debug)]
pub struct RemoteList {
    peer: Peer,
    entries: Vec<Entry>,
    state: Mutex<RemoteState>,
    /// Each endpoint's fence mark when the list was prepared
    /// ([`railyard_control::EndpointView::revoked_below`]).
    fences: Vec<u64>,
}

impl RemoteList {
    /// How many descriptors it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Descriptor `index` as `(addr, len)`.
    pub fn get(&self, index: usize) -> Option<(u64, u64)> {
        self.entries.get(index).map(|entry| (entry.addr, entry.len))
    }

    /// The peer it was prepared for.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Its regions with the peer's current keys, or why it may no longer be posted: the
    /// peer fenced this engine off, or a region it names is gone or of a new generation.
    fn current(&self) -> Result<Arc<[RemoteRegion]>, TransferError> {
        let views = self.peer.views();
        if views
            .iter()
            .zip(&self.fences)
            .any(|(view, &mark)| view.revoked_below() != mark)
        {
            return Err(TransferError::StaleList {
                side: "remote",
                reason: format!(
                    "peer {} revoked this engine since the list was prepared: work prepared \
                     before a fence never reaches it; prepare the list again",
                    self.peer.name()
                ),
            });
        }
        let versions = descriptor_versions(&self.peer);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.versions == versions {
            return Ok(state.regions.clone());
        }
        let descriptor = self.peer.descriptor();
        let mut renewed = Vec::with_capacity(state.regions.len());
        for region in state.regions.iter() {
            let now = descriptor
                .regions
                .iter()
                .find(|r| r.generation == region.generation && r.base == region.base)
                .ok_or_else(|| TransferError::StaleList {
                    side: "remote",
                    reason: format!(
                        "peer {} deregistered or registered anew its region at {:#x}+{} since \
                         the list was prepared (generation {} is gone); prepare the list again",
                        self.peer.name(),
                        region.base,
                        region.len,
                        region.generation
                    ),
                })?;
            renewed.push(RemoteRegion {
                rkeys: now.rkeys.clone(),
                ..region.clone()
            });
        }
        state.regions = renewed.into();
        state.versions = versions;
        Ok(state.regions.clone())
    }
}

fn descriptor_versions(peer: &Peer) -> u64 {
    peer.views()
        .iter()
        .map(|view| view.descriptor_version())
        .sum()
}

impl Engine {
    /// Resolves local ranges to their registered regions once, for
    /// [`EngineSubmitter::submit_prepared`]: each `(addr, len)` must lie inside one region
    /// registered with this engine.
    ///
    /// # Errors
    /// [`PrepareError::Empty`] or [`PrepareError::LocalUnregistered`] naming the first bad
    /// range.
    pub fn prepare_local(&self, ranges: &[(u64, u64)]) -> Result<LocalList, PrepareError> {
        let version = self.regions_version();
        let mut regions = self.regions();
        // Tables of one region per registration call stay small; look them up by address.
        regions.sort_by_key(|region| region.addr);
        let mut table: Vec<LocalRegion> = Vec::new();
        let mut ids: Vec<(u64, u32)> = Vec::new();
        let mut entries = Vec::with_capacity(ranges.len());
        for (index, &(addr, len)) in ranges.iter().enumerate() {
            if len == 0 {
                return Err(PrepareError::Empty { index });
            }
            let after = regions.partition_point(|region| region.addr <= addr);
            let region = after
                .checked_sub(1)
                .and_then(|at| regions.get(at))
                .filter(|region| region.contains(addr, len))
                .ok_or(PrepareError::LocalUnregistered { index, addr, len })?;
            let slot = match ids.iter().find(|(id, _)| *id == region.id) {
                Some(&(_, slot)) => slot,
                None => {
                    let (_, registrations) = self
                        .registrations(region.id)
                        .ok_or(PrepareError::LocalUnregistered { index, addr, len })?;
                    let slot = table.len() as u32;
                    table.push(LocalRegion {
                        id: region.id,
                        numa: region.numa,
                        lkeys: registrations.iter().map(|r| r.lkey).collect(),
                    });
                    ids.push((region.id, slot));
                    slot
                }
            };
            entries.push(Entry {
                addr,
                len,
                region: slot,
            });
        }
        Ok(LocalList {
            engine: self.incarnation(),
            entries,
            regions: table,
            checked_at: AtomicU64::new(version),
        })
    }
}

impl Peer {
    /// Resolves ranges of this peer's memory to its regions and keys once, from its newest
    /// descriptor, for [`EngineSubmitter::submit_prepared`]: each `(addr, len)` must lie
    /// inside one region the peer lets this engine reach. The list outlives reconnects; a
    /// region the peer deregisters or registers anew, or a revoke by the peer, makes it
    /// stale. A region the peer registered after its descriptor came is not seen: call
    /// [`Engine::refresh_descriptor`] first.
    ///
    /// # Errors
    /// [`PrepareError::Empty`] or [`PrepareError::RemoteRange`] naming the first bad range.
    pub fn prepare(&self, ranges: &[(u64, u64)]) -> Result<RemoteList, PrepareError> {
        let fences = self.views().iter().map(|v| v.revoked_below()).collect();
        let versions = descriptor_versions(self);
        let descriptor = self.descriptor();
        let mut table: Vec<RemoteRegion> = Vec::new();
        let mut entries = Vec::with_capacity(ranges.len());
        let mut last: Option<(u64, u64, u32)> = None;
        for (index, &(addr, len)) in ranges.iter().enumerate() {
            if len == 0 {
                return Err(PrepareError::Empty { index });
            }
            let slot = match last {
                Some((base, end, slot))
                    if addr >= base && addr.checked_add(len).is_some_and(|e| e <= end) =>
                {
                    slot
                }
                _ => {
                    let region = descriptor.region_for(addr, len).ok_or_else(|| {
                        PrepareError::RemoteRange {
                            index,
                            peer: self.name().to_string(),
                            addr,
                            len,
                        }
                    })?;
                    let slot = match table.iter().position(|r| r.generation == region.generation) {
                        Some(slot) => slot as u32,
                        None => {
                            table.push(RemoteRegion {
                                base: region.base,
                                len: region.len,
                                generation: region.generation,
                                rkeys: region.rkeys.clone(),
                            });
                            (table.len() - 1) as u32
                        }
                    };
                    last = Some((region.base, region.base.saturating_add(region.len), slot));
                    slot
                }
            };
            entries.push(Entry {
                addr,
                len,
                region: slot,
            });
        }
        Ok(RemoteList {
            peer: self.clone(),
            entries,
            state: Mutex::new(RemoteState {
                versions,
                regions: table.into(),
            }),
            fences,
        })
    }
}

/// How [`EngineSubmitter::submit_prepared_with`] posts.
#[derive(Clone, Debug)]
pub struct PostOptions {
    /// Sent to the peer once every descriptor completed (never if one failed).
    pub notify: Option<Vec<u8>>,
    /// Adjacent descriptors contiguous on both sides (and in one region each side) go as
    /// one request (default). False: one request per descriptor pair, always.
    pub merge: bool,
    /// When the batch fails what is left (default: the engine's deadline from now).
    pub deadline: Option<Instant>,
}

impl Default for PostOptions {
    fn default() -> Self {
        Self {
            notify: None,
            merge: true,
            deadline: None,
        }
    }
}

/// A run of descriptor pairs contiguous on both sides, in one region each side.
#[derive(Clone, Copy, Debug)]
struct Run {
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    local_region: u32,
    remote_region: u32,
}

impl EngineSubmitter {
    /// Posts descriptor pairs by index: `local[local_indices[i]]` with
    /// `remote[remote_indices[i]]`, in the order given, as one batch of **one request** to
    /// the remote list's peer — done when every pair is, failed with the first failure of
    /// any — merging adjacent pairs contiguous on both sides; `notify` goes to the peer
    /// once all of it completed.
    ///
    /// # Errors
    /// As [`Self::submit_prepared_with`].
    pub fn submit_prepared(
        &mut self,
        op: Op,
        local: &LocalList,
        local_indices: &[usize],
        remote: &RemoteList,
        remote_indices: &[usize],
        notify: Option<Vec<u8>>,
    ) -> Result<Batch, TransferError> {
        let options = PostOptions {
            notify,
            ..PostOptions::default()
        };
        self.submit_prepared_with(op, local, local_indices, remote, remote_indices, &options)
    }

    /// [`Self::submit_prepared`] with [`PostOptions`]. Nothing is looked up per descriptor:
    /// the lists hold their keys, and are checked whole (cheaply, unless regions changed).
    /// No pairs make a batch done at once.
    ///
    /// # Errors
    /// Nothing is queued on any of them: [`TransferError::IndicesMismatch`] when the index
    /// lists differ in length; [`TransferError::IndexOutOfRange`] for an index past its
    /// list; [`TransferError::LengthMismatch`] when a pair's lengths differ;
    /// [`TransferError::StaleList`] for a list prepared against regions since deregistered
    /// or registered anew, or before the peer revoked this engine;
    /// [`TransferError::ForeignList`] for a list of another engine (a remote list of a peer
    /// another engine opened);
    /// [`TransferError::NotConnected`], [`TransferError::NotificationTooLarge`] and
    /// [`TransferError::PollerStopped`] as [`Self::submit`].
    pub fn submit_prepared_with(
        &mut self,
        op: Op,
        local: &LocalList,
        local_indices: &[usize],
        remote: &RemoteList,
        remote_indices: &[usize],
        options: &PostOptions,
    ) -> Result<Batch, TransferError> {
        let started = Instant::now();
        if local_indices.len() != remote_indices.len() {
            return Err(TransferError::IndicesMismatch {
                local: local_indices.len(),
                remote: remote_indices.len(),
            });
        }
        let max = railyard_control::wire::MAX_NOTIFY;
        if let Some(notification) = &options.notify {
            if notification.len() > max {
                return Err(TransferError::NotificationTooLarge {
                    len: notification.len(),
                    max,
                });
            }
        }
        local.check(&self.engine)?;
        let peer = remote.peer();
        if peer.engine != self.engine.incarnation() {
            return Err(TransferError::ForeignList {
                side: "remote",
                engine: self.engine.name().to_string(),
            });
        }
        let remote_regions = remote.current()?;
        self.connected_rails(peer)?;
        let totals = self.slice_pairs(
            op,
            (local, local_indices),
            (remote, remote_indices, &remote_regions),
            options.merge,
        )?;
        let deadline = options
            .deadline
            .unwrap_or_else(|| started + self.engine.default_deadline());
        let prepared = Instant::now();
        let batch = self
            .submitter
            .submit(1, &self.specs, deadline)
            .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        if let Some(notification) = &options.notify {
            self.engine
                .notify_after(peer, notification.clone(), &batch)
                .map_err(|_| TransferError::PollerStopped { rail: 0 })?;
        }
        self.timing = SubmitTiming {
            prepare: prepared - started,
            post: prepared.elapsed(),
        };
        self.prepared_totals = totals;
        let mut requests = [0; 2];
        let mut moved = [0; 2];
        requests[op.index()] = 1;
        moved[op.index()] = totals.bytes;
        self.count_totals(peer, requests, moved);
        Ok(batch)
    }

    /// What the last prepared submission posted.
    pub fn last_prepared(&self) -> PreparedTotals {
        self.prepared_totals
    }

    /// Checks every pair, merges contiguous ones into runs and splits each run at the
    /// slice size onto the connected rails (as [`Self::submit`] spreads transfers), into
    /// `self.specs`, in one pass.
    fn slice_pairs(
        &mut self,
        op: Op,
        (local, local_indices): (&LocalList, &[usize]),
        (remote, remote_indices, remote_regions): (&RemoteList, &[usize], &[RemoteRegion]),
        merge: bool,
    ) -> Result<PreparedTotals, TransferError> {
        let opcode = match op {
            Op::Write => Opcode::Write,
            Op::Read => Opcode::Read,
        };
        let slice_size = self.engine.slice_size() as u64;
        self.specs.clear();
        self.specs.reserve(local_indices.len());
        eligible(&self.connected, &mut self.chosen);
        let mut slicer = Slicer {
            opcode,
            slice_size,
            local,
            remote_regions,
            submitter: self,
        };
        let mut totals = PreparedTotals {
            pairs: local_indices.len(),
            ..PreparedTotals::default()
        };
        let mut open: Option<Run> = None;
        for (position, (&l, &r)) in local_indices.iter().zip(remote_indices).enumerate() {
            let (here, there) = pair(local, l, remote, r, position)?;
            if let Some(run) = open.as_mut() {
                if merge
                    && run.local_region == here.region
                    && run.remote_region == there.region
                    && run.local_addr + run.len == here.addr
                    && run.remote_addr + run.len == there.addr
                {
                    run.len += here.len;
                    continue;
                }
                slicer.slice(*run)?;
                totals.runs += 1;
                totals.bytes += run.len;
            }
            open = Some(Run {
                local_addr: here.addr,
                remote_addr: there.addr,
                len: here.len,
                local_region: here.region,
                remote_region: there.region,
            });
        }
        if let Some(run) = open {
            slicer.slice(run)?;
            totals.runs += 1;
            totals.bytes += run.len;
        }
        totals.slices = self.specs.len();
        if totals.slices > u32::MAX as usize {
            // One request counts its slices in 32 bits.
            return Err(TransferError::TooManyDescriptors {
                slices: totals.slices,
                max: u32::MAX as usize,
            });
        }
        Ok(totals)
    }
}

/// Pair `position`: local descriptor `l` and remote descriptor `r`, when both exist and
/// have one length.
fn pair(
    local: &LocalList,
    l: usize,
    remote: &RemoteList,
    r: usize,
    position: usize,
) -> Result<(Entry, Entry), TransferError> {
    let out_of_range = |side, index, len| TransferError::IndexOutOfRange {
        side,
        position,
        index,
        len,
    };
    let here = *local
        .entries
        .get(l)
        .ok_or_else(|| out_of_range("local", l, local.entries.len()))?;
    let there = *remote
        .entries
        .get(r)
        .ok_or_else(|| out_of_range("remote", r, remote.entries.len()))?;
    if here.len != there.len {
        return Err(TransferError::LengthMismatch {
            position,
            local: here.len,
            remote: there.len,
        });
    }
    Ok((here, there))
}

/// Checks index pairs against two lists without posting anything: what
/// [`EngineSubmitter::submit_prepared`] would refuse of them (the lists' staleness aside),
/// for callers that build a transfer once and post it many times.
///
/// # Errors
/// [`TransferError::IndicesMismatch`], [`TransferError::IndexOutOfRange`] and
/// [`TransferError::LengthMismatch`], for the first bad pair.
pub fn check_pairs(
    local: &LocalList,
    local_indices: &[usize],
    remote: &RemoteList,
    remote_indices: &[usize],
) -> Result<(), TransferError> {
    if local_indices.len() != remote_indices.len() {
        return Err(TransferError::IndicesMismatch {
            local: local_indices.len(),
            remote: remote_indices.len(),
        });
    }
    for (position, (&l, &r)) in local_indices.iter().zip(remote_indices).enumerate() {
        pair(local, l, remote, r, position)?;
    }
    Ok(())
}

/// Splits runs into slices for one prepared submission.
struct Slicer<'a> {
    opcode: Opcode,
    slice_size: u64,
    local: &'a LocalList,
    remote_regions: &'a [RemoteRegion],
    submitter: &'a mut EngineSubmitter,
}

impl Slicer<'_> {
    fn slice(&mut self, run: Run) -> Result<(), TransferError> {
        let EngineSubmitter {
            specs,
            next_rail,
            connected,
            chosen,
            ..
        } = &mut *self.submitter;
        // Both indices come from the lists' own tables.
        let here = &self.local.regions[run.local_region as usize];
        let there = &self.remote_regions[run.remote_region as usize];
        let mut offset = 0;
        while offset < run.len {
            let len = self.slice_size.min(run.len - offset);
            let pick = match chosen.as_slice() {
                [only] => *only,
                _ => least_loaded(connected, chosen, *next_rail, here.numa),
            };
            *next_rail = next_rail.wrapping_add(1);
            let option = &mut connected[pick];
            option.load += len;
            let (Some(&lkey), Some(&rkey)) = (
                here.lkeys.get(option.rail),
                there.rkeys.get(usize::from(option.remote_rail)),
            ) else {
                return Err(TransferError::StaleList {
                    side: "remote",
                    reason: format!(
                        "the peer's descriptor has no key for its rail {}, or this engine \
                         none for its rail {}; prepare the list again",
                        option.remote_rail, option.rail
                    ),
                });
            };
            specs.push(SliceSpec {
                rail: option.rail,
                request: 0,
                opcode: self.opcode,
                local_addr: run.local_addr + offset,
                lkey,
                remote_addr: run.remote_addr + offset,
                rkey,
                len: len as u32,
                imm: 0,
                endpoint: option.endpoint,
                epoch: option.epoch,
                generation: there.generation as u32,
            });
            offset += len;
        }
        Ok(())
    }
}
