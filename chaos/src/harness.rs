//! What every scenario's initiators share: the bound on each wait, the address they listen
//! on, and raw ways to write and read a target's memory.

use std::net::SocketAddr;
use std::time::Duration;

use railyard_engine::control::EndpointView;
use railyard_engine::dataplane::fabric::{MemoryRegion, Opcode};
use railyard_engine::dataplane::{Epoch, SliceSpec};

/// Every wait in a scenario ends by this bound.
pub const BOUND: Duration = Duration::from_secs(10);

/// The bytes of an engine region.
///
/// # Safety
/// No transfer of `region` may be in flight while the slice is used, and the engine that
/// allocated it must outlive the slice.
pub(crate) unsafe fn region_bytes<'a>(region: railyard_engine::Region) -> &'a mut [u8] {
    // SAFETY: the region is registered memory of `region.len` bytes owned by the engine,
    // which outlives the slice; the caller keeps transfers away while it is used.
    unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len as usize) }
}

/// Reads `into.len` bytes at `remote` of the process listening at `addr`, through a peer
/// opened afresh (whoever listens there now), into `into`; whether every byte came.
pub(crate) fn read_through_fresh_peer(
    engine: &railyard_engine::Engine,
    addr: SocketAddr,
    remote: u64,
    into: railyard_engine::Region,
) -> bool {
    let (Ok(peer), Ok(mut submitter)) = (engine.open(&addr.to_string()), engine.submitter()) else {
        return false;
    };
    let read = railyard_engine::Transfer {
        op: railyard_engine::Op::Read,
        local: into,
        local_offset: 0,
        remote_addr: remote,
        len: into.len,
    };
    let Ok(batch) = submitter.submit(&peer, &[read]) else {
        return false;
    };
    batch.wait(std::time::Instant::now() + railyard_engine::dataplane::DEFAULT_DEADLINE + BOUND);
    batch.outcomes() == vec![Some(railyard_engine::dataplane::RequestOutcome::Done)]
}

pub(crate) fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A WRITE slice of `len` bytes for request `request`: from `local` (region, offset) to
/// `remote` (address, rkey) through `view`'s endpoint, prepared for `epoch` and for the
/// generation `view`'s descriptor gives the remote region (none if it lists no such region:
/// the slice can then only fail).
pub(crate) fn write_slice(
    view: &EndpointView,
    epoch: Epoch,
    request: u32,
    local: (MemoryRegion, u64),
    remote: (u64, u32),
    len: usize,
) -> SliceSpec {
    SliceSpec {
        rail: 0,
        request,
        opcode: Opcode::Write,
        local_addr: local.0.addr + local.1,
        lkey: local.0.lkey,
        remote_addr: remote.0,
        rkey: remote.1,
        len: len as u32,
        imm: 0,
        endpoint: view.id,
        epoch,
        generation: view
            .descriptor()
            .and_then(|descriptor| {
                let region = descriptor.region_for(remote.0, len as u64)?;
                Some(region.generation as u32)
            })
            .unwrap_or(0),
    }
}
