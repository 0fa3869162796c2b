//! [`OfiFabric`]: an [`OfiRail`] as its poller drives it — the only code that posts on the
//! rail's endpoint, reads its completion queue and changes its address vector.
//!
//! Each operation carries a slot of this fabric as its context: the slot starts with room
//! for the provider's own context (`FI_CONTEXT2`) and says what the completion reports (work
//! request, queue pair, opcode, length). A peer address is in the address vector once,
//! however many queue pairs (epochs) name it: a repeated handshake with the same address
//! inserts nothing; the entry goes when the last queue pair naming it is retired and its
//! last operation has completed.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, RwLockReadGuard};

use railyard_ofi_sys as sys;

use super::rail::{AnnouncedRegions, LocalRegistration, OfiError, OfiRail, strerror};
use super::status::map_error;
use crate::fabric::{
    Access, Fabric, FabricError, FabricLimits, Opcode, PostError, QpNum, WcStatus, WorkCompletion,
    WorkRequest, WrId,
};
use crate::{EndpointId, Epoch};

/// Completions taken per `fi_cq_read`.
const READ_BATCH: usize = 64;

/// One operation's context. `provider` must come first: the slot's address is the
/// operation's context pointer, and the provider may use that many bytes of it.
#[repr(C)]
struct OpSlot {
    provider: [*mut c_void; 8],
    index: u32,
    busy: bool,
    wr_id: WrId,
    qp: QpNum,
    opcode: Opcode,
    len: u32,
}

/// A queue pair: a peer's address-vector entry at one epoch of one endpoint.
struct QueuePair {
    address: Vec<u8>,
    /// The target's tag, sent with every immediate.
    tag: u32,
    fi_addr: sys::fi_addr_t,
    retired: bool,
    outstanding: usize,
}

/// An address-vector entry and the queue pairs that name it.
struct AvEntry {
    fi_addr: sys::fi_addr_t,
    users: usize,
}

/// The poller's side of an [`OfiRail`]. See the module docs.
pub struct OfiFabric {
    rail: Arc<OfiRail>,
    qps: HashMap<u32, QueuePair>,
    addresses: HashMap<Vec<u8>, AvEntry>,
    next_qp: u32,
    /// Allocated one by one (`Box::leak`) and only ever reached through these pointers:
    /// an operation's context is its slot's address, which must not move, and the provider
    /// may write its part while the operation runs. Freed on drop, unless an operation is
    /// still in flight (then they are leaked: the provider may still write them).
    slots: Vec<NonNull<OpSlot>>,
    free: Vec<u32>,
    ready: VecDeque<WorkCompletion>,
    entries: Vec<sys::fi_cq_data_entry>,
    /// Scratch: each request of the post being made, checked.
    checked: Vec<Result<Target, WcStatus>>,
}

// SAFETY: the raw pointers in the slots are the provider's context scratch, only ever
// touched by the provider during calls made from the thread that owns this fabric; the
// fabric moves to its poller thread once and stays there.
unsafe impl Send for OfiFabric {}

impl std::fmt::Debug for OfiFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfiFabric")
            .field("rail", &self.rail.name())
            .field("queue_pairs", &self.qps.len())
            .field("addresses", &self.addresses.len())
            .finish()
    }
}

impl OfiRail {
    /// The poller's side of the rail: at most one.
    ///
    /// # Errors
    /// When one was made already.
    pub fn fabric(self: &Arc<Self>) -> Result<OfiFabric, OfiError> {
        if self.fabric_taken.swap(true, Ordering::AcqRel) {
            return Err(OfiError::Call {
                call: "OfiRail::fabric",
                code: -i64::from(sys::FI_EBUSY),
                reason: "the rail's poller already has its fabric".into(),
            });
        }
        Ok(OfiFabric::new(self.clone()))
    }
}

impl OfiFabric {
    fn new(rail: Arc<OfiRail>) -> Self {
        Self {
            rail,
            qps: HashMap::new(),
            addresses: HashMap::new(),
            next_qp: 1,
            slots: Vec::new(),
            free: Vec::new(),
            ready: VecDeque::new(),
            entries: vec![sys::fi_cq_data_entry::default(); READ_BATCH],
            checked: Vec::new(),
        }
    }

    /// Address-vector entries held (one per distinct peer address in use).
    pub fn address_vector_entries(&self) -> usize {
        self.addresses.len()
    }

    /// A free slot, marked busy for `request` on `qp`: its pointer is the operation's
    /// context.
    fn take_slot(&mut self, request: &WorkRequest, qp: QpNum) -> (u32, NonNull<OpSlot>) {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                let index = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
                self.slots.push(NonNull::from(Box::leak(Box::new(OpSlot {
                    provider: [ptr::null_mut(); 8],
                    index,
                    busy: false,
                    wr_id: WrId(0),
                    qp: QpNum(0),
                    opcode: Opcode::Write,
                    len: 0,
                }))));
                index
            }
        };
        let slot = self.slots[index as usize];
        // SAFETY: a free slot: no operation names it, so nothing else reaches its memory;
        // written through its own pointer, field by field.
        unsafe {
            let raw = slot.as_ptr();
            (*raw).busy = true;
            (*raw).wr_id = request.wr_id;
            (*raw).qp = qp;
            (*raw).opcode = request.opcode;
            (*raw).len = request.len;
        }
        (index, slot)
    }

    /// Frees slot `index` (its operation completed, or was never posted).
    fn release_slot(&mut self, index: u32) {
        if let Some(slot) = self.slots.get(index as usize) {
            // SAFETY: its operation is over: the provider no longer writes it.
            unsafe { (*slot.as_ptr()).busy = false };
            self.free.push(index);
        }
    }

    /// Reads the completion queue into `ready` (and progresses the provider); true when
    /// anything was read.
    fn progress(&mut self) -> bool {
        let mut moved = false;
        loop {
            // SAFETY: `entries` holds READ_BATCH entries of the format the queue was opened
            // with (FI_CQ_FORMAT_DATA); only this fabric reads the queue.
            let read = unsafe {
                sys::railyard_fi_cq_read(
                    self.rail.cq,
                    self.entries.as_mut_ptr().cast(),
                    self.entries.len(),
                )
            };
            if read > 0 {
                moved = true;
                for i in 0..usize::try_from(read).unwrap_or(0) {
                    let entry = self.entries[i];
                    self.completed(&entry, WcStatus::Success);
                }
                continue;
            }
            if read as i64 == -i64::from(sys::FI_EAVAIL) {
                let mut error = sys::fi_cq_err_entry::default();
                // SAFETY: reads one error entry into `error`; only this fabric reads the queue.
                let got = unsafe { sys::railyard_fi_cq_readerr(self.rail.cq, &mut error, 0) };
                if got <= 0 {
                    return moved;
                }
                moved = true;
                let entry = sys::fi_cq_data_entry {
                    op_context: error.op_context,
                    flags: error.flags,
                    len: error.len,
                    buf: error.buf,
                    data: error.data,
                };
                let status = map_error(error.err.unsigned_abs(), error.prov_errno);
                tracing::debug!(
                    target: "railyard::ofi",
                    rail = self.rail.name(),
                    err = error.err,
                    reason = %strerror(i64::from(error.err)),
                    prov_errno = error.prov_errno,
                    ?status,
                    "a work request failed"
                );
                self.completed(&entry, status);
                continue;
            }
            // -FI_EAGAIN: nothing more now; anything else: the queue is unusable, and the
            // requests in flight are flushed by retiring their queue pairs.
            return moved;
        }
    }

    /// One completion: an operation of ours (`op_context` is its slot) or a peer's remote
    /// CQ data (an immediate).
    fn completed(&mut self, entry: &sys::fi_cq_data_entry, status: WcStatus) {
        if entry.op_context.is_null() {
            if entry.flags & u64::from(sys::FI_REMOTE_CQ_DATA) != 0 && status == WcStatus::Success {
                self.rail.deliver_immediate(entry.data);
            }
            return;
        }
        let context = entry.op_context.cast::<OpSlot>();
        // SAFETY: a completion's context is what its operation was posted with: one of this
        // fabric's slots, live as long as the fabric (checked just below).
        let index = unsafe { (*context).index };
        if self.slots.get(index as usize).map(|slot| slot.as_ptr()) != Some(context) {
            return;
        }
        // SAFETY: one of this fabric's slots, whose operation just completed: the provider
        // is done with it.
        let (busy, wr_id, qp, opcode, len) = unsafe {
            let raw = context;
            (
                (*raw).busy,
                (*raw).wr_id,
                (*raw).qp,
                (*raw).opcode,
                (*raw).len,
            )
        };
        if !busy {
            return;
        }
        self.release_slot(index);
        let mut status = status;
        let mut drained = false;
        if let Some(pair) = self.qps.get_mut(&qp.0) {
            pair.outstanding = pair.outstanding.saturating_sub(1);
            if pair.retired {
                // Reported only now, once the operation no longer runs.
                status = WcStatus::WrFlushErr;
                drained = pair.outstanding == 0;
            }
        }
        self.ready
            .push_back(WorkCompletion::ended(wr_id, opcode, len, qp, status));
        if drained {
            self.forget(qp);
        }
    }

    /// Drops a retired queue pair whose operations have all completed, and its peer's
    /// address-vector entry if no other queue pair names it.
    fn forget(&mut self, qp: QpNum) {
        let Some(pair) = self.qps.remove(&qp.0) else {
            return;
        };
        let Some(entry) = self.addresses.get_mut(&pair.address) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users > 0 {
            return;
        }
        let mut fi_addr = entry.fi_addr;
        self.addresses.remove(&pair.address);
        // SAFETY: removes one entry this fabric inserted and no operation names any more.
        let code = unsafe { sys::railyard_fi_av_remove(self.rail.av, &mut fi_addr, 1, 0) };
        if code != 0 {
            tracing::warn!(
                target: "railyard::ofi",
                rail = self.rail.name(),
                reason = %strerror(i64::from(code)),
                "cannot remove a peer from the address vector"
            );
        }
    }

    /// The address-vector entry for `address`, inserted if it is not there.
    fn entry_for(&mut self, address: &[u8]) -> Result<sys::fi_addr_t, String> {
        // fi_av_insert takes no length: the provider reads an address of its own format's
        // size, which is this endpoint's.
        if address.len() != self.rail.address().len() {
            return Err(format!(
                "the peer's address is {} bytes; this provider's are {}",
                address.len(),
                self.rail.address().len()
            ));
        }
        if let Some(entry) = self.addresses.get_mut(address) {
            entry.users += 1;
            return Ok(entry.fi_addr);
        }
        let mut fi_addr: sys::fi_addr_t = u64::MAX;
        // SAFETY: inserts one address of the provider's format, as long as this endpoint's
        // (checked above); only this fabric changes the vector.
        let inserted = unsafe {
            sys::railyard_fi_av_insert(
                self.rail.av,
                address.as_ptr().cast(),
                1,
                &mut fi_addr,
                0,
                ptr::null_mut(),
            )
        };
        if inserted != 1 || fi_addr == u64::MAX {
            return Err(format!(
                "the address vector refused the peer's address ({})",
                if inserted < 0 {
                    strerror(i64::from(inserted))
                } else {
                    "not inserted".into()
                }
            ));
        }
        self.addresses
            .insert(address.to_vec(), AvEntry { fi_addr, users: 1 });
        Ok(fi_addr)
    }
}

/// Where a checked request goes, and its local descriptor.
struct Target {
    rkey: u32,
    /// The virtual address, or the offset in the peer's region (no `FI_MR_VIRT_ADDR`).
    remote_addr: u64,
    desc: usize,
}

/// What one post checks its requests against, read-locked once for the whole list: this
/// process's registrations and the regions the peer announced.
struct Checker<'a> {
    local: RwLockReadGuard<'a, HashMap<u32, LocalRegistration>>,
    remote: RwLockReadGuard<'a, HashMap<Vec<u8>, AnnouncedRegions>>,
    virt_addr: bool,
    tagged_immediates: bool,
}

impl<'a> Checker<'a> {
    fn new(rail: &'a OfiRail) -> Self {
        Self {
            local: rail.local.read().unwrap_or_else(PoisonError::into_inner),
            remote: rail
                .remote_regions
                .read()
                .unwrap_or_else(PoisonError::into_inner),
            virt_addr: rail.virt_addr(),
            tagged_immediates: rail.tagged_immediates,
        }
    }

    /// What to post for `request` to the peer at `address`, or the status it fails with here.
    fn check(&self, request: &WorkRequest, address: &[u8]) -> Result<Target, WcStatus> {
        let len = u64::from(request.len);
        let desc = if len == 0 {
            0
        } else {
            let registration = self.local.get(&request.lkey).ok_or(WcStatus::LocProtErr)?;
            if !registration.region.contains(request.local_addr, len) {
                return Err(WcStatus::LocProtErr);
            }
            // A READ writes its local range.
            if request.opcode == Opcode::Read
                && !registration.region.access.contains(Access::LOCAL_WRITE)
            {
                return Err(WcStatus::LocProtErr);
            }
            registration.desc
        };
        if request.opcode == Opcode::WriteWithImm && !self.tagged_immediates {
            return Err(WcStatus::RemInvReqErr);
        }
        let virt_addr = self.virt_addr;
        // A zero-length request (a bare immediate) names no memory, but the provider checks
        // whatever key it carries: it borrows the start of any region the peer announced.
        let (rkey, remote_addr) = match self.remote.get(address).map(|known| &known.regions) {
            None if virt_addr && len > 0 => (request.rkey, request.remote_addr),
            None => return Err(WcStatus::RemAccessErr),
            Some(regions) if len == 0 => regions
                .iter()
                .find(|(_, (_, _, access))| access.contains(Access::REMOTE_WRITE))
                .map(|(&rkey, &(base, _, _))| (rkey, if virt_addr { base } else { 0 }))
                .ok_or(WcStatus::RemAccessErr)?,
            Some(regions) => {
                let &(base, size, access) =
                    regions.get(&request.rkey).ok_or(WcStatus::RemAccessErr)?;
                let needed = match request.opcode {
                    Opcode::Read => Access::REMOTE_READ,
                    Opcode::Write | Opcode::WriteWithImm => Access::REMOTE_WRITE,
                };
                if !access.contains(needed) {
                    return Err(WcStatus::RemAccessErr);
                }
                let offset = request
                    .remote_addr
                    .checked_sub(base)
                    .filter(|offset| offset.checked_add(len).is_some_and(|end| end <= size))
                    .ok_or(WcStatus::RemAccessErr)?;
                let addr = if virt_addr {
                    request.remote_addr
                } else {
                    offset
                };
                (request.rkey, addr)
            }
        };
        Ok(Target {
            rkey,
            remote_addr,
            desc,
        })
    }
}

impl Drop for OfiFabric {
    fn drop(&mut self) {
        let in_flight = self.slots.iter().any(|slot| {
            // SAFETY: a slot of this fabric; only its flag is read.
            unsafe { (*slot.as_ptr()).busy }
        });
        if in_flight {
            // The provider may still write their context: leave them be.
            return;
        }
        for slot in self.slots.drain(..) {
            // SAFETY: made by `Box::leak` in `take_slot`, freed once, with no operation left.
            drop(unsafe { Box::from_raw(slot.as_ptr()) });
        }
    }
}

impl Fabric for OfiFabric {
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let peer = self
            .rail
            .staged
            .take_for_connect(endpoint, epoch, self.rail.name())?;
        let fi_addr = self
            .entry_for(&peer.address)
            .map_err(|reason| FabricError::Connect {
                endpoint,
                epoch,
                reason,
            })?;
        let qp = QpNum(self.next_qp);
        self.next_qp = self.next_qp.wrapping_add(1).max(1);
        self.qps.insert(
            qp.0,
            QueuePair {
                address: peer.address,
                tag: peer.tag,
                fi_addr,
                retired: false,
                outstanding: 0,
            },
        );
        Ok(qp)
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let refuse = |posted, error| Err(PostError { posted, error });
        let (fi_addr, tag) = match self.qps.get(&qp.0) {
            None => return refuse(0, FabricError::UnknownQp { qp }),
            Some(pair) if pair.retired => return refuse(0, FabricError::QpInError { qp }),
            Some(pair) => (pair.fi_addr, pair.tag),
        };
        // Every request checked first: the last one that will be posted goes without
        // FI_MORE, so the provider never waits for a request that is not coming.
        let mut checked = std::mem::take(&mut self.checked);
        checked.clear();
        {
            let checker = Checker::new(&self.rail);
            let address = &self.qps[&qp.0].address;
            checked.extend(
                requests
                    .iter()
                    .map(|request| checker.check(request, address)),
            );
        }
        let last_posted = checked.iter().rposition(Result::is_ok);
        let outcome = self.post_checked(qp, fi_addr, tag, requests, &checked, last_posted);
        self.checked = checked;
        outcome
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.ready.len() < max {
            self.progress();
        }
        let taken = max.min(self.ready.len());
        out.extend(self.ready.drain(..taken));
        taken
    }

    fn retire(&mut self, qp: QpNum) {
        let Some(pair) = self.qps.get_mut(&qp.0) else {
            return;
        };
        pair.retired = true;
        if pair.outstanding == 0 {
            self.forget(qp);
        }
    }

    /// A libfabric operation cannot be recalled short of closing the rail's endpoint, which
    /// every peer shares: the provider keeps its operations, whose completions are still
    /// reported (as flushes, and ignored by the poller). See docs/fabrics.md, known gaps.
    fn abandon(&mut self, _qp: QpNum) -> bool {
        false
    }

    fn serve(&mut self) -> bool {
        self.rail.manual_progress() && self.progress()
    }

    fn serving(&self) -> bool {
        self.rail.manual_progress() && self.rail.remotely_accessible.load(Ordering::Relaxed) > 0
    }

    fn limits(&self) -> FabricLimits {
        self.rail.limits()
    }
}

impl OfiFabric {
    /// Posts `requests` on `qp` (to `fi_addr`, immediates tagged `tag`) as `checked` says:
    /// a refused one completes at once, the others go to the provider, the one at
    /// `last_posted` without FI_MORE.
    fn post_checked(
        &mut self,
        qp: QpNum,
        fi_addr: sys::fi_addr_t,
        tag: u32,
        requests: &[WorkRequest],
        checked: &[Result<Target, WcStatus>],
        last_posted: Option<usize>,
    ) -> Result<(), PostError> {
        let refuse = |posted, error| Err(PostError { posted, error });
        for (posted, (request, check)) in requests.iter().zip(checked).enumerate() {
            let target = match *check {
                Ok(ref target) => target,
                Err(status) => {
                    // Refused here: it completes at once and the provider never sees it.
                    self.ready
                        .push_back(WorkCompletion::of(request, qp, status));
                    continue;
                }
            };
            let (index, slot) = self.take_slot(request, qp);
            let iov = libc::iovec {
                iov_base: request.local_addr as *mut c_void,
                iov_len: request.len as usize,
            };
            let rma = sys::fi_rma_iov {
                addr: target.remote_addr,
                len: request.len as usize,
                key: u64::from(target.rkey),
            };
            let mut desc = target.desc as *mut c_void;
            let msg = sys::fi_msg_rma {
                msg_iov: &iov,
                desc: &mut desc,
                iov_count: 1,
                addr: fi_addr,
                rma_iov: &rma,
                rma_iov_count: 1,
                context: slot.as_ptr().cast(),
                data: (u64::from(tag) << 32) | u64::from(request.imm),
            };
            // A WRITE completes once its bytes are visible in the target's memory (as a
            // verbs WRITE is acknowledged after placement), not when they left here: what the
            // application does next (notify the target) relies on it.
            let mut flags = u64::from(sys::FI_COMPLETION | sys::FI_DELIVERY_COMPLETE);
            if Some(posted) != last_posted {
                flags |= u64::from(sys::FI_MORE);
            }
            // SAFETY: `msg` and what it points to live across the call (libfabric copies what
            // it keeps); the local range was just checked to lie in a registration of this
            // rail, which stays mapped while requests on it are in flight (the engine's
            // deregistration waits for the poller's round); the context is a slot of this
            // fabric, reserved for this operation until its completion.
            let code = unsafe {
                match request.opcode {
                    Opcode::Read => sys::railyard_fi_readmsg(self.rail.ep, &msg, flags),
                    Opcode::Write => sys::railyard_fi_writemsg(self.rail.ep, &msg, flags),
                    Opcode::WriteWithImm => sys::railyard_fi_writemsg(
                        self.rail.ep,
                        &msg,
                        flags | u64::from(sys::FI_REMOTE_CQ_DATA),
                    ),
                }
            };
            if code == 0 {
                if let Some(pair) = self.qps.get_mut(&qp.0) {
                    pair.outstanding += 1;
                }
                continue;
            }
            self.release_slot(index);
            if code as i64 == -i64::from(sys::FI_EAGAIN) {
                // Backpressure: progress, and the rest waits for the next round (whose last
                // request goes without FI_MORE).
                self.progress();
                return refuse(posted, FabricError::SendQueueFull { qp });
            }
            tracing::warn!(
                target: "railyard::ofi",
                rail = self.rail.name(),
                qp = qp.0,
                reason = %strerror(code as i64),
                "the provider refused a work request"
            );
            return refuse(posted, FabricError::QpInError { qp });
        }
        Ok(())
    }
}
