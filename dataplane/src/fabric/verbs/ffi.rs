//! Safe owners of verbs objects, as rust-ibverbs shapes them: each wrapper holds its parent
//! (a memory region its protection domain, a queue pair its domain and completion queue),
//! so destruction runs in dependency order whatever the drop order; queue-pair set-up is a
//! typestate ([`PreparedQp::handshake`] → [`QueuePair`]). A failed destroy in `Drop` cannot
//! return an error, so it is reported on stderr — loudly, never silently leaked.
//!
//! Not exercised on this development host (no RDMA device): `make test-rdma` on a machine
//! with a NIC or SoftRoCE runs the data path.

use std::ffi::CStr;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::{
    ibv_alloc_pd, ibv_close_device, ibv_context, ibv_cq, ibv_create_cq, ibv_create_qp,
    ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_cq, ibv_destroy_qp, ibv_free_device_list,
    ibv_get_device_list, ibv_get_device_name, ibv_gid, ibv_modify_qp, ibv_mr, ibv_open_device,
    ibv_pd, ibv_port_attr, ibv_qp, ibv_qp_init_attr, ibv_qp_type, ibv_query_gid, ibv_reg_mr,
};

use super::attrs::{self, QpConfig, RemoteQp};
use super::mtu::PathMtu;

/// Why a verbs call failed.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {source}")]
pub struct VerbsError {
    /// The verbs call.
    pub call: &'static str,
    /// The errno it left.
    #[source]
    pub source: io::Error,
}

fn failed(call: &'static str) -> VerbsError {
    VerbsError {
        call,
        source: io::Error::last_os_error(),
    }
}

fn failed_with(call: &'static str, code: i32) -> VerbsError {
    VerbsError {
        call,
        source: io::Error::from_raw_os_error(code),
    }
}

/// Reports a destroy that failed during `Drop`.
fn report_leak(call: &str, code: i32) {
    if code != 0 {
        tracing::warn!(
            target: "railyard::verbs",
            call,
            error = %io::Error::from_raw_os_error(code.abs()),
            "releasing a verbs resource failed: it leaks"
        );
    }
}

/// An open RDMA device.
///
/// # Invariants
/// `context` is an open device context, closed exactly once, when this value drops.
#[derive(Debug)]
pub struct Context {
    context: NonNull<ibv_context>,
    name: String,
}

// SAFETY:
// - libibverbs contexts are thread-safe for the calls made here (creating objects, querying);
//   the data path of each queue pair and completion queue is used by one poller thread.
unsafe impl Send for Context {}
// SAFETY: as for Send.
unsafe impl Sync for Context {}

/// `IBV_LINK_LAYER_ETHERNET`: an anonymous enum in `verbs.h` that rdma-sys does not bind.
const LINK_LAYER_ETHERNET: u8 = 2;

/// What one port says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Whether it is ACTIVE.
    pub active: bool,
    /// Its LID (InfiniBand).
    pub lid: u16,
    /// Its active MTU.
    pub mtu: PathMtu,
    /// Ethernet (RoCE) or InfiniBand.
    pub ethernet: bool,
}

impl Context {
    /// Opens the device called `name`.
    ///
    /// # Errors
    /// When listing or opening fails, or no device has that name.
    pub fn open(name: &str) -> Result<Arc<Self>, VerbsError> {
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed below.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Err(failed("ibv_get_device_list"));
        }
        let mut context = std::ptr::null_mut();
        for index in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY:
            // - The list holds `count` valid devices; names are NUL-terminated strings the
            //   devices own; the device is opened before the list is freed.
            unsafe {
                let device = *list.add(index);
                if CStr::from_ptr(ibv_get_device_name(device)).to_bytes() == name.as_bytes() {
                    context = ibv_open_device(device);
                    break;
                }
            }
        }
        let open_error = io::Error::last_os_error();
        // SAFETY: the list came from ibv_get_device_list; the context does not borrow it.
        unsafe { ibv_free_device_list(list) };
        let context = NonNull::new(context).ok_or(VerbsError {
            call: "ibv_open_device",
            source: if open_error.raw_os_error().unwrap_or(0) == 0 {
                io::Error::new(io::ErrorKind::NotFound, format!("no RDMA device {name}"))
            } else {
                open_error
            },
        })?;
        Ok(Arc::new(Self {
            context,
            name: name.to_string(),
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_context {
        self.context.as_ptr()
    }

    /// Port `port`'s state, LID, active MTU and link layer.
    ///
    /// # Errors
    /// When the query fails.
    pub fn query_port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: `ibv_port_attr` is plain old data; all-zero is valid.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (invariant) and `attr` is a writable port attr.
        let code = unsafe { rdma_sys::___ibv_query_port(self.as_ptr(), port, &mut attr) };
        if code != 0 {
            return Err(failed_with("ibv_query_port", code));
        }
        Ok(PortInfo {
            active: attr.state == rdma_sys::ibv_port_state::IBV_PORT_ACTIVE,
            lid: attr.lid,
            mtu: PathMtu::from_ibv(attr.active_mtu).unwrap_or(PathMtu::Mtu1024),
            ethernet: attr.link_layer == LINK_LAYER_ETHERNET,
        })
    }

    /// How many RDMA READs (and atomics) a queue pair of this device may have outstanding:
    /// (as target, as initiator).
    ///
    /// # Errors
    /// When the query fails.
    pub fn read_depths(&self) -> Result<(u8, u8), VerbsError> {
        // SAFETY: `ibv_device_attr` is plain old data; all-zero is valid.
        let mut attr: rdma_sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open (invariant) and `attr` is a writable device attr.
        let code = unsafe { rdma_sys::ibv_query_device(self.as_ptr(), &mut attr) };
        if code != 0 {
            return Err(failed_with("ibv_query_device", code));
        }
        let depth = |value: i32| u8::try_from(value.max(0)).unwrap_or(u8::MAX);
        Ok((depth(attr.max_qp_rd_atom), depth(attr.max_qp_init_rd_atom)))
    }

    /// Entry `index` of port `port`'s GID table.
    ///
    /// # Errors
    /// When the query fails.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], VerbsError> {
        // SAFETY: `ibv_gid` is a union of plain bytes; all-zero is valid.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is writable.
        let code = unsafe { ibv_query_gid(self.as_ptr(), port, i32::from(index), &mut gid) };
        if code != 0 {
            return Err(failed_with("ibv_query_gid", code));
        }
        // SAFETY: every bit pattern of the union is valid raw bytes.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: open (invariant); every child holds an `Arc` to this context, so none is
        // alive any more.
        report_leak("ibv_close_device", unsafe {
            ibv_close_device(self.as_ptr())
        });
    }
}

/// A protection domain: every memory region and queue pair of a rail lives in one.
#[derive(Debug)]
pub struct ProtectionDomain {
    pd: NonNull<ibv_pd>,
    context: Arc<Context>,
}

// SAFETY: see Context; a PD is used for creation calls only, which verbs serializes.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as for Send.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates one on `context`.
    ///
    /// # Errors
    /// When the device refuses.
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open.
        let pd = NonNull::new(unsafe { ibv_alloc_pd(context.as_ptr()) })
            .ok_or_else(|| failed("ibv_alloc_pd"))?;
        Ok(Arc::new(Self {
            pd,
            context: context.clone(),
        }))
    }

    /// Its device.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every region and queue pair holds an `Arc` to this domain: none is left.
        report_leak("ibv_dealloc_pd", unsafe {
            ibv_dealloc_pd(self.pd.as_ptr())
        });
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: an MR is immutable after registration; its keys are read from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for Send.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with `access` (verbs' `IBV_ACCESS_*` bits).
    ///
    /// # Safety
    /// The memory must stay mapped until this value drops: the NIC reads and writes it.
    ///
    /// # Errors
    /// When the device refuses (too much pinned memory, bad range).
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Self, VerbsError> {
        // SAFETY: the domain is live; the caller guarantees the range stays mapped.
        let mr = unsafe { ibv_reg_mr(pd.pd.as_ptr(), addr.cast(), len, access as i32) };
        let mr = NonNull::new(mr).ok_or_else(|| failed("ibv_reg_mr"))?;
        Ok(Self {
            mr,
            _pd: pd.clone(),
        })
    }

    /// The key for local use.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the region is registered (we own it) and its fields are immutable.
        unsafe { self.mr.as_ref().lkey }
    }

    /// The key peers use.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once, here.
        report_leak("ibv_dereg_mr", unsafe { ibv_dereg_mr(self.mr.as_ptr()) });
    }
}

/// A completion queue: one per rail for sends, polled by its poller only; one per
/// target-side queue pair for its receives, polled by the control thread that owns it.
#[derive(Debug)]
pub struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    _context: Arc<Context>,
}

// SAFETY: created on one thread and polled by the rail's poller only; queue pairs created
// elsewhere keep only its pointer for `ibv_create_qp`.
unsafe impl Send for CompletionQueue {}
// SAFETY: as for Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A queue of `depth` entries on `context`.
    ///
    /// # Errors
    /// When the device refuses.
    pub fn new(context: &Arc<Context>, depth: i32) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open; no channel, no vector.
        let cq = unsafe {
            ibv_create_cq(
                context.as_ptr(),
                depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let cq = NonNull::new(cq).ok_or_else(|| failed("ibv_create_cq"))?;
        Ok(Arc::new(Self {
            cq,
            _context: context.clone(),
        }))
    }

    /// Takes up to `out.len()` completions; returns how many.
    ///
    /// # Errors
    /// When the device reports a polling error.
    pub fn poll(&self, out: &mut [rdma_sys::ibv_wc]) -> Result<usize, VerbsError> {
        let max = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: the queue is live and `out` holds `max` writable entries.
        let count = unsafe { rdma_sys::ibv_poll_cq(self.cq.as_ptr(), max, out.as_mut_ptr()) };
        usize::try_from(count).map_err(|_| failed_with("ibv_poll_cq", -count))
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: every queue pair holds an `Arc` to this queue: none is left.
        report_leak("ibv_destroy_cq", unsafe {
            ibv_destroy_cq(self.cq.as_ptr())
        });
    }
}

/// Owns a raw queue pair and destroys it once.
#[derive(Debug)]
struct RawQp {
    qp: NonNull<ibv_qp>,
    _pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
}

// SAFETY: a queue pair is created and connected on the control thread, then moved to its
// poller, the only thread that posts on it.
unsafe impl Send for RawQp {}

impl RawQp {
    fn modify(
        &self,
        (mut attr, mask): (rdma_sys::ibv_qp_attr, i32),
        call: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is live and `attr` is a valid attribute set for `mask`.
        let code = unsafe { ibv_modify_qp(self.qp.as_ptr(), &mut attr, mask) };
        if code == 0 {
            Ok(())
        } else {
            Err(failed_with(call, code))
        }
    }

    fn num(&self) -> u32 {
        // SAFETY: the queue pair is live; its number never changes.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// Posts `count` receive requests without scatter/gather entries: enough for
    /// WRITE_WITH_IMM, whose data goes to the address the writer names and whose
    /// immediate arrives in the receive's completion.
    fn post_receives(&self, count: usize) -> Result<(), VerbsError> {
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `ibv_recv_wr` is plain old data; all-zero (no entries, no next) is valid.
        let mut wrs: Vec<rdma_sys::ibv_recv_wr> =
            (0..count).map(|_| unsafe { std::mem::zeroed() }).collect();
        let base = wrs.as_mut_ptr();
        for index in 0..count - 1 {
            // SAFETY: `index` and `index + 1` are inside `wrs`, which does not move until
            // the post below returns.
            unsafe { (*base.add(index)).next = base.add(index + 1) };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue pair is live and at least in INIT; the list is linked above,
        // its requests carry no scatter/gather entries, and `wrs` outlives the call.
        let code = unsafe { rdma_sys::ibv_post_recv(self.qp.as_ptr(), base, &mut bad) };
        if code == 0 {
            Ok(())
        } else {
            Err(failed_with("ibv_post_recv", code))
        }
    }
}

impl Drop for RawQp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, here.
        report_leak("ibv_destroy_qp", unsafe {
            ibv_destroy_qp(self.qp.as_ptr())
        });
    }
}

/// A queue pair in INIT, waiting for its peer's side.
#[derive(Debug)]
pub struct PreparedQp {
    raw: RawQp,
    config: QpConfig,
    psn: u32,
}

/// A queue pair in RTS: what a poller posts on.
#[derive(Debug)]
pub struct QueuePair {
    raw: RawQp,
}

impl PreparedQp {
    /// Creates an RC queue pair on `pd` whose sends complete into `send_cq` and receives
    /// into `recv_cq`, and moves it to INIT.
    ///
    /// # Errors
    /// When the device refuses.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        config: QpConfig,
        psn: u32,
    ) -> Result<Self, VerbsError> {
        // SAFETY: `ibv_qp_init_attr` is plain old data; all-zero is valid.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq.as_ptr();
        init.recv_cq = recv_cq.cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = config.caps.max_send_wr;
        init.cap.max_recv_wr = config.caps.max_recv_wr;
        init.cap.max_send_sge = config.caps.max_send_sge;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = config.caps.max_inline_data;
        // SAFETY: the domain and queue are live; `init` is valid for the call.
        let qp = unsafe { ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| failed("ibv_create_qp"))?;
        let raw = RawQp {
            qp,
            _pd: pd.clone(),
            _send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
        };
        raw.modify(attrs::init(&config), "ibv_modify_qp(INIT)")?;
        Ok(Self {
            raw,
            config,
            psn: psn & 0x00ff_ffff,
        })
    }

    /// Its number.
    pub fn num(&self) -> u32 {
        self.raw.num()
    }

    /// Its first PSN.
    pub fn psn(&self) -> u32 {
        self.psn
    }

    /// Posts `count` receives (before RTR, so that no WRITE_WITH_IMM ever finds none).
    ///
    /// # Errors
    /// When the device refuses.
    pub fn post_receives(&self, count: usize) -> Result<(), VerbsError> {
        self.raw.post_receives(count)
    }

    /// INIT → RTR → RTS towards `remote` at `mtu` (already negotiated).
    ///
    /// # Errors
    /// When a transition is refused (the queue pair is destroyed).
    pub fn handshake(self, remote: &RemoteQp, mtu: PathMtu) -> Result<QueuePair, VerbsError> {
        self.raw.modify(
            attrs::ready_to_receive(&self.config, remote, mtu),
            "ibv_modify_qp(RTR)",
        )?;
        self.raw.modify(
            attrs::ready_to_send(&self.config, self.psn),
            "ibv_modify_qp(RTS)",
        )?;
        Ok(QueuePair { raw: self.raw })
    }
}

impl QueuePair {
    /// Its number.
    pub fn num(&self) -> u32 {
        self.raw.num()
    }

    /// Posts a linked list of send requests (one doorbell). Returns the index of the first
    /// refused request with the error, if any.
    ///
    /// # Safety
    /// `first` heads a list linked through `next` whose requests and scatter/gather entries
    /// stay valid for the call, naming memory registered in this queue pair's domain.
    pub unsafe fn post(
        &mut self,
        first: *mut rdma_sys::ibv_send_wr,
    ) -> Result<(), (*mut rdma_sys::ibv_send_wr, VerbsError)> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue pair is live and in RTS (typestate); the caller guarantees the
        // list.
        let code = unsafe { rdma_sys::ibv_post_send(self.raw.qp.as_ptr(), first, &mut bad) };
        if code == 0 {
            Ok(())
        } else {
            Err((bad, failed_with("ibv_post_send", code)))
        }
    }

    /// Appends the immediates of the WRITE_WITH_IMM requests that arrived since the last
    /// call to `out`, oldest first, and posts a receive for each one consumed. Only for a
    /// queue pair with a receive completion queue of its own ([`PreparedQp::new`] with a
    /// `recv_cq` no other queue pair uses).
    ///
    /// # Errors
    /// When polling or re-posting fails (a queue pair in ERR flushes its receives and
    /// takes no new ones).
    pub fn take_immediates(&mut self, out: &mut Vec<u32>) -> Result<(), VerbsError> {
        const BATCH: usize = 32;
        // SAFETY: `ibv_wc` is plain old data; all-zero is valid.
        let mut wcs: [rdma_sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        loop {
            let taken = self.raw.recv_cq.poll(&mut wcs)?;
            let mut consumed = 0;
            for wc in &wcs[..taken] {
                if wc.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                    return Err(VerbsError {
                        call: "receive completion",
                        source: io::Error::other(format!(
                            "{:?} on queue pair {}",
                            super::status::map_status(wc.status),
                            wc.qp_num
                        )),
                    });
                }
                consumed += 1;
                if wc.opcode == rdma_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    // SAFETY: a RECV_RDMA_WITH_IMM completion carries an immediate.
                    let imm = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
                    out.push(u32::from_be(imm));
                }
            }
            self.raw.post_receives(consumed)?;
            if taken < BATCH {
                return Ok(());
            }
        }
    }

    /// Moves it to ERR: everything outstanding completes as flushed.
    ///
    /// # Errors
    /// When the transition is refused.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        self.raw.modify(attrs::error(), "ibv_modify_qp(ERR)")
    }
}
