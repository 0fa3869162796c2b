//! The soft NIC: executes one work request the way an RDMA NIC would, on the poller's thread.
//!
//! Checks come in the order a requester and responder NIC make them, each with verbs' status:
//! - a message longer than 2^31 bytes → LOC_LEN_ERR;
//! - the lkey names no live registration of this device, or a READ lands in memory
//!   registered without LOCAL_WRITE → LOC_PROT_ERR; the local range leaves the lkey's
//!   region → LOC_LEN_ERR;
//! - the peer's queue pair does not allow the operation (its access flags) → REM_INV_REQ_ERR;
//! - the rkey names no live registration in the peer's table (unknown, deregistered,
//!   re-registered), the remote range leaves it, or it lacks REMOTE_WRITE / REMOTE_READ →
//!   REM_ACCESS_ERR;
//! - the peer process is gone when the bytes move (ESRCH) → RETRY_EXC_ERR.
//!
//! Bytes move with one plain copy when the peer is this process or the remote region is
//! engine-allocated memory we mapped ([`super::SoftBuffer`]), else with
//! `process_vm_writev` / `process_vm_readv`, which reach any memory of the peer. A
//! WRITE_WITH_IMM delivers its immediate to the peer's inbox after its data, and waits
//! (receiver not ready) while that inbox is full.

use std::io;

use super::inbox::RecvCompletion;
use super::qp::Peer;
use super::regions::RegionTable;
use super::sys::{self, Direction};
use crate::fabric::{Access, Opcode, WcStatus, WorkRequest};

/// Longest message verbs allows.
const MAX_MESSAGE: u32 = 1 << 31;

/// How one attempt at a work request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Execution {
    /// Done, with this status.
    Completed(WcStatus),
    /// A WRITE_WITH_IMM whose receiver has no room yet: nothing was done; try again.
    ReceiverNotReady,
}

/// Executes `request` from this device (`local`) to `peer`, inside the queue pair's access
/// fence ([`super::fence`]): the peer's keys are checked and the bytes moved inside one
/// [`InboxWriter::enter`](super::inbox::InboxWriter::enter) section, so a peer that
/// withdrew a key or revoked the queue pair and then fenced knows no copy that missed it is
/// still running. A revoked queue pair fails with RETRY_EXC_ERR (the peer no longer answers
/// on it).
pub(crate) fn execute(local: &RegionTable, peer: &mut Peer, request: &WorkRequest) -> Execution {
    let _section = peer.inbox.enter();
    if peer.inbox.is_revoked() {
        return Execution::Completed(WcStatus::RetryExcErr);
    }
    execute_inside(local, peer, request)
}

fn execute_inside(local: &RegionTable, peer: &mut Peer, request: &WorkRequest) -> Execution {
    if let Err(unfinished) = check_and_copy(local, peer, request) {
        return unfinished;
    }
    if request.opcode == Opcode::WriteWithImm {
        let delivered = peer.inbox.try_push(RecvCompletion {
            imm: request.imm,
            byte_len: request.len,
        });
        // Room was checked before the copy and this thread is the inbox's only producer.
        debug_assert!(delivered, "inbox room vanished under its only producer");
    }
    Execution::Completed(WcStatus::Success)
}

fn check_and_copy(
    local: &RegionTable,
    peer: &mut Peer,
    request: &WorkRequest,
) -> Result<(), Execution> {
    let fail = |status| Err(Execution::Completed(status));
    let len = u64::from(request.len);
    if request.len > MAX_MESSAGE {
        return fail(WcStatus::LocLenErr);
    }
    if len == 0 {
        return check_zero_length(peer, request);
    }
    let Some(local_region) = local.lookup(request.lkey) else {
        return fail(WcStatus::LocProtErr);
    };
    if request.opcode == Opcode::Read && !local_region.access.contains(Access::LOCAL_WRITE) {
        return fail(WcStatus::LocProtErr);
    }
    if !local_region.covers(request.local_addr, len) {
        return fail(WcStatus::LocLenErr);
    }
    let (needed, direction) = match request.opcode {
        Opcode::Write | Opcode::WriteWithImm => (Access::REMOTE_WRITE, Direction::Write),
        Opcode::Read => (Access::REMOTE_READ, Direction::Read),
    };
    if !peer.access.contains(needed) {
        return fail(WcStatus::RemInvReqErr);
    }
    let Some(remote_region) = peer.table.lookup(request.rkey) else {
        peer.mapped.remove(&request.rkey);
        return fail(WcStatus::RemAccessErr);
    };
    if !remote_region.access.contains(needed) || !remote_region.covers(request.remote_addr, len) {
        return fail(WcStatus::RemAccessErr);
    }
    if request.opcode == Opcode::WriteWithImm && !peer.inbox.has_room() {
        return Err(Execution::ReceiverNotReady);
    }
    if peer.same_process {
        let (from, to) = match direction {
            Direction::Write => (request.local_addr, request.remote_addr),
            Direction::Read => (request.remote_addr, request.local_addr),
        };
        // SAFETY:
        // - Both ranges lie inside live registrations of this process (checked above), and
        //   `SoftDevice::register`'s contract makes registered memory valid for reads and
        //   writes while it is registered.
        // - `copy` allows the ranges to overlap (a process may write into itself).
        // - Concurrent access by the application to the target range is the RDMA contract:
        //   the bytes are undefined until the completion, as with a NIC's DMA.
        unsafe {
            std::ptr::copy(from as *const u8, to as *mut u8, request.len as usize);
        }
        return Ok(());
    }
    if let Some(mapping) = peer.mapping(request.rkey, &remote_region) {
        let mapped = mapping.addr() + (request.remote_addr - remote_region.base);
        let (from, to) = match direction {
            Direction::Write => (request.local_addr, mapped),
            Direction::Read => (mapped, request.local_addr),
        };
        // SAFETY:
        // - The local range lies inside a live registration of this process, valid for
        //   reads and writes by `SoftDevice::register`'s contract (or our own allocation).
        // - The remote range lies inside the peer's registration (checked above), and our
        //   mapping of its memfd is at least that long (checked when mapped), live while the
        //   peer holds it.
        // - Distinct mappings of this process: they do not overlap unless the peer is us,
        //   and `copy` allows overlap anyway.
        unsafe {
            std::ptr::copy(from as *const u8, to as *mut u8, request.len as usize);
        }
        return Ok(());
    }
    match sys::process_vm(
        direction,
        peer.pid as libc::pid_t,
        request.local_addr,
        request.remote_addr,
        request.len as usize,
    ) {
        Ok(()) => Ok(()),
        Err(error) => fail(copy_error_status(&error)),
    }
}

/// A zero-length request names no memory, so neither key is checked (as in verbs): only
/// the queue pair's access and, for WRITE_WITH_IMM (a bare notification), the inbox.
fn check_zero_length(peer: &Peer, request: &WorkRequest) -> Result<(), Execution> {
    let needed = match request.opcode {
        Opcode::Write | Opcode::WriteWithImm => Access::REMOTE_WRITE,
        Opcode::Read => Access::REMOTE_READ,
    };
    if !peer.access.contains(needed) {
        return Err(Execution::Completed(WcStatus::RemInvReqErr));
    }
    if request.opcode == Opcode::WriteWithImm && !peer.inbox.has_room() {
        return Err(Execution::ReceiverNotReady);
    }
    Ok(())
}

/// The completion status of a failed cross-process copy.
fn copy_error_status(error: &io::Error) -> WcStatus {
    match error.raw_os_error() {
        // The peer process is gone: the transport cannot reach it.
        Some(libc::ESRCH) => WcStatus::RetryExcErr,
        // The peer registered memory it no longer maps (or we may no longer access it): the
        // responder refuses the access.
        Some(libc::EFAULT | libc::EPERM) => WcStatus::RemAccessErr,
        _ => WcStatus::RetryExcErr,
    }
}
