//! [`OfiRail`]: one provider domain, endpoint, completion queue and address vector, and the
//! memory registered on it. Shared by the control plane (staging peers), the application
//! (registering memory) and the rail's poller (its [`OfiFabric`](super::OfiFabric), which
//! `OfiRail::fabric` makes once: the only user of the endpoint, completion queue and address
//! vector).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, PoisonError, RwLock};

use railyard_ofi_sys as sys;

use crate::fabric::staging::Staging;
use crate::fabric::{Access, FabricLimits, MemoryRegion};
use crate::{EndpointId, Epoch};

/// The libfabric API version railyard is written against (Debian 12 ships 1.17).
const API_VERSION: u32 = sys::api_version(1, 17);
/// Entries of the completion queue.
const COMPLETION_QUEUE: usize = 8192;
/// Entries the address vector starts with (it grows as needed).
const ADDRESS_VECTOR: usize = 1024;

/// Which provider (and optionally which of its domains) a rail opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfiConfig {
    /// The provider, as `fi_info -l` names it: `efa`, `tcp;ofi_rxm`, `shm`, `sockets`.
    pub provider: String,
    /// The domain (for `efa`, the device; for `tcp`, the interface, e.g. `lo`); `None`: the
    /// provider's first.
    pub domain: Option<String>,
}

/// Why libfabric refused something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OfiError {
    /// No domain of the provider offers what railyard needs.
    #[error(
        "libfabric provider {provider:?}{} offers no reliable-datagram endpoint with RMA: {reason}",
        domain.as_ref().map_or(String::new(), |d| format!(" (domain {d:?})"))
    )]
    NoProvider {
        /// The provider asked for.
        provider: String,
        /// The domain asked for.
        domain: Option<String>,
        /// `fi_getinfo`'s answer.
        reason: String,
    },
    /// A libfabric call failed.
    #[error("{call} failed: {reason} ({code})")]
    Call {
        /// The call.
        call: &'static str,
        /// Its (negative) return code.
        code: i64,
        /// `fi_strerror` of it.
        reason: String,
    },
    /// The provider chose a key wider than the 32 bits railyard's descriptors carry.
    #[error("the provider gave memory key {key:#x}, wider than 32 bits")]
    KeyTooWide {
        /// The key.
        key: u64,
    },
    /// The region is not registered here.
    #[error("no registration with lkey {lkey:#x} on this rail")]
    NotRegistered {
        /// Its local key.
        lkey: u32,
    },
    /// A zero-length or otherwise unusable range.
    #[error("cannot register {len} bytes at {addr:#x}")]
    BadRange {
        /// Its start.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

/// The text of a libfabric error code (positive or negative).
pub(crate) fn strerror(code: i64) -> String {
    let code = i32::try_from(code.unsigned_abs()).unwrap_or(i32::MAX);
    // SAFETY: fi_strerror returns a pointer to a static string for any code.
    let text = unsafe { CStr::from_ptr(sys::fi_strerror(code)) };
    text.to_string_lossy().into_owned()
}

/// `Ok` for 0 (or any non-negative count); the call's error otherwise.
pub(crate) fn check(call: &'static str, code: i64) -> Result<(), OfiError> {
    if code >= 0 {
        Ok(())
    } else {
        Err(OfiError::Call {
            call,
            code,
            reason: strerror(code),
        })
    }
}

/// A peer as the control plane stages it: the address of its endpoint (`fi_getname`) and
/// the tag its side of the connection gave (the high 32 bits of each immediate's remote CQ
/// data, by which the target tells whose immediate it is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfiPeer {
    /// The provider's address bytes.
    pub address: Vec<u8>,
    /// The target's tag for this connection.
    pub tag: u32,
}

/// A peer's regions as it announced them: (first byte, length) by rkey, and who announced
/// them (the peer's incarnation: a newer one at the same address replaces them).
pub(crate) struct AnnouncedRegions {
    owner: u64,
    /// By rkey: first byte, length, and what peers may do.
    pub(crate) regions: HashMap<u32, (u64, u64, Access)>,
}

/// A registration as the poller checks requests against it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalRegistration {
    pub(crate) region: MemoryRegion,
    /// `fi_mr_desc` with `FI_MR_LOCAL`, else 0.
    pub(crate) desc: usize,
}

/// One registration.
struct Registered {
    mr: *mut sys::fid_mr,
    region: MemoryRegion,
}

/// The provider's memory-registration requirements (`domain_attr.mr_mode`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MrMode {
    /// FI_MR_LOCAL: local buffers need their descriptor in every request.
    pub(crate) local: bool,
    /// FI_MR_VIRT_ADDR: peers address registered memory by virtual address.
    pub(crate) virt_addr: bool,
    /// FI_MR_PROV_KEY: the provider picks keys.
    pub(crate) prov_key: bool,
    /// FI_MR_ENDPOINT: registrations are bound to an endpoint and enabled.
    pub(crate) endpoint: bool,
}

/// A rail on a libfabric domain. See the module docs.
pub struct OfiRail {
    name: String,
    provider: String,
    info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    pub(crate) cq: *mut sys::fid_cq,
    pub(crate) av: *mut sys::fid_av,
    pub(crate) ep: *mut sys::fid_ep,
    address: Vec<u8>,
    mr_mode: MrMode,
    manual_progress: bool,
    pub(crate) limits: FabricLimits,
    registrations: Mutex<HashMap<u32, Registered>>,
    /// This process's registrations by lkey, read by the poller for every request: its
    /// local range is checked against them, and with `FI_MR_LOCAL` their descriptor goes
    /// with it.
    pub(crate) local: RwLock<HashMap<u32, LocalRegistration>>,
    /// Whether remote CQ data is wide enough (8 bytes) to carry a connection's tag beside
    /// an immediate.
    pub(crate) tagged_immediates: bool,
    /// Registrations peers may access: a manual-progress rail serves while there are any.
    pub(crate) remotely_accessible: AtomicU32,
    /// The regions peers announced (first byte and length by rkey, by the peer's address):
    /// the poller checks every request against them before posting, and without
    /// FI_MR_VIRT_ADDR turns virtual addresses into offsets from the region's start.
    pub(crate) remote_regions: RwLock<HashMap<Vec<u8>, AnnouncedRegions>>,
    next_lkey: AtomicU32,
    pub(crate) staged: Staging<OfiPeer>,
    /// Immediates that arrived, by the tag of the connection they came on; only tags opened
    /// with [`Self::open_immediates`] are kept.
    immediates: Mutex<HashMap<u32, Vec<u32>>>,
    pub(super) fabric_taken: AtomicBool,
}

// SAFETY: the domain is opened FI_THREAD_SAFE, so registering memory (the only call made
// from several threads) may run beside the poller; the endpoint, completion queue and
// address vector are used only by the one `OfiFabric` (`fabric_taken`), on its poller's
// thread; `info` is read-only after `open`.
unsafe impl Send for OfiRail {}
// SAFETY: as for Send.
unsafe impl Sync for OfiRail {}

impl std::fmt::Debug for OfiRail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfiRail")
            .field("name", &self.name)
            .field("provider", &self.provider)
            .field("mr_mode", &self.mr_mode)
            .finish()
    }
}

/// `ofi_rxm`'s parameter: how often (µs) reading a completion queue also handles the
/// provider's connection events.
const RXM_CM_PROGRESS_INTERVAL: &str = "FI_OFI_RXM_CM_PROGRESS_INTERVAL";

/// Sets what railyard needs of libfabric's parameters in this process's environment, once,
/// unless the environment already sets them. libfabric reads them when it starts (at the
/// process's first `fi_getinfo`), so this must run before: railyard's own first
/// `fi_getinfo` calls it, and the `railyard` command and the Python module call it before
/// anything else runs. A program that embeds railyard and starts other threads first
/// should call it at the top of `main` (or set the variables itself), and a process where
/// another library (an MPI, NCCL's plugin) starts libfabric first must set them before it
/// starts. Child processes inherit them.
///
/// `FI_OFI_RXM_CM_PROGRESS_INTERVAL=0`: every completion-queue read that finds nothing also
/// handles `ofi_rxm`'s connection events. A connection the target closed (`tcp` closes it on
/// a request it refuses) is then dropped by the first empty read after its cancelled
/// requests were read, before the endpoint's next queue pair posts anything: that queue
/// pair gets a connection of its own. By default `ofi_rxm` looks at most every 10 ms (longer
/// on a loaded host), and until then hands the next queue pair to that address the dead
/// connection: every request it carries fails with `ENOTCONN`, and the endpoint's
/// replacements count as flaps until its circuit opens. (`FI_AV_REMOVE_CLEANUP`, which drops
/// the connection with the address-vector entry, would do it too, but crashes libfabric 1.17
/// when queue pairs are retired by the thousand.) A value set in the environment is kept;
/// opening a `tcp;ofi_rxm` rail then warns if it is not 0.
pub fn settle_parameters() {
    static SETTLED: Once = Once::new();
    SETTLED.call_once(|| {
        if std::env::var_os(RXM_CM_PROGRESS_INTERVAL).is_some() {
            return;
        }
        // SAFETY: `set_var` is sound while no other thread reads or writes the environment.
        // Runs once, and before this process's first fi_getinfo (each goes through `hints`,
        // which waits here), so libfabric is not reading it; std's own readers take the lock
        // `set_var` takes. The `railyard` command and the Python module call this before
        // they start a thread. Called later, from `hints` in a program that already runs
        // threads of its own, native code reading the environment on one of them at this
        // instant is the residual risk the docs above tell such programs how to avoid.
        unsafe { std::env::set_var(RXM_CM_PROGRESS_INTERVAL, "0") };
    });
}

/// Warns, once per process, when a `tcp;ofi_rxm` rail opens with a connection-event
/// interval other than railyard's (see [`settle_parameters`]).
fn warn_of_a_slow_connection_check(provider: &str) {
    static WARNED: Once = Once::new();
    if !provider.contains("ofi_rxm") {
        return;
    }
    let Some(interval) = std::env::var_os(RXM_CM_PROGRESS_INTERVAL) else {
        return;
    };
    if interval == "0" {
        return;
    }
    WARNED.call_once(|| {
        tracing::warn!(
            target: "railyard::ofi",
            interval = %interval.to_string_lossy(),
            "{RXM_CM_PROGRESS_INTERVAL} is not 0: after a peer closes a connection (tcp does \
             on a request it refuses), the next queue pairs to it fail until ofi_rxm notices"
        );
    });
}

/// Hints for `fi_getinfo`: an RDM endpoint with RMA, every memory-registration mode railyard
/// can honour, context space in every operation, a thread-safe domain.
///
/// # Safety
/// The result must be freed with `fi_freeinfo`.
unsafe fn hints(provider: Option<&str>) -> Result<*mut sys::fi_info, OfiError> {
    // Every fi_getinfo goes through here, and the first one initializes libfabric.
    settle_parameters();
    // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info with its attribute structs.
    let hints = unsafe { sys::fi_dupinfo(ptr::null()) };
    if hints.is_null() {
        return Err(OfiError::Call {
            call: "fi_allocinfo",
            code: -i64::from(sys::FI_ENOMEM),
            reason: strerror(-i64::from(sys::FI_ENOMEM)),
        });
    }
    // SAFETY: `hints` and its attribute structs were just allocated by libfabric; strings
    // given to it are strdup'd, as fi_freeinfo frees them.
    unsafe {
        (*hints).caps = u64::from(
            sys::FI_RMA | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE,
        );
        (*hints).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode = (sys::FI_MR_LOCAL
            | sys::FI_MR_VIRT_ADDR
            | sys::FI_MR_ALLOCATED
            | sys::FI_MR_PROV_KEY
            | sys::FI_MR_ENDPOINT) as i32;
        (*(*hints).domain_attr).threading = sys::fi_threading_FI_THREAD_SAFE;
        if let Some(provider) = provider {
            let name = CString::new(provider).map_err(|_| OfiError::NoProvider {
                provider: provider.into(),
                domain: None,
                reason: "the name holds a NUL byte".into(),
            })?;
            (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
        }
    }
    Ok(hints)
}

/// The providers that offer railyard what it needs on this machine, by name (`efa`,
/// `tcp;ofi_rxm`, `shm`, …), each once.
pub fn providers() -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: hints are freed below; the list fi_getinfo returns is walked read-only and
    // freed once.
    unsafe {
        let Ok(hints) = hints(None) else {
            return names;
        };
        let mut list = ptr::null_mut();
        let code = sys::fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut list);
        sys::fi_freeinfo(hints);
        if code != 0 {
            return names;
        }
        let mut seen = HashSet::new();
        let mut info = list;
        while !info.is_null() {
            let name = (*(*info).fabric_attr).prov_name;
            if !name.is_null() {
                let name = CStr::from_ptr(name).to_string_lossy().into_owned();
                if seen.insert(name.clone()) {
                    names.push(name);
                }
            }
            info = (*info).next;
        }
        sys::fi_freeinfo(list);
    }
    names
}

impl OfiRail {
    /// Opens rail `name` on `config`'s provider (and domain): fabric, domain, completion
    /// queue, address vector and an enabled RDM endpoint.
    ///
    /// # Errors
    /// [`OfiError::NoProvider`] when the provider (or domain) is missing or cannot do RMA on
    /// RDM endpoints; [`OfiError::Call`] when opening a part fails.
    pub fn open(name: impl Into<String>, config: &OfiConfig) -> Result<Arc<Self>, OfiError> {
        let no_provider = |reason: String| OfiError::NoProvider {
            provider: config.provider.clone(),
            domain: config.domain.clone(),
            reason,
        };
        // SAFETY: hints and the fi_getinfo list are freed on every path; the chosen entry is
        // duplicated (fi_dupinfo) before the list goes.
        let info = unsafe {
            let hints = hints(Some(&config.provider))?;
            let mut list = ptr::null_mut();
            let code = sys::fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut list);
            sys::fi_freeinfo(hints);
            if code != 0 {
                return Err(no_provider(strerror(i64::from(code))));
            }
            let mut chosen = list;
            if let Some(domain) = &config.domain {
                while !chosen.is_null() {
                    let name = (*(*chosen).domain_attr).name;
                    if !name.is_null() && CStr::from_ptr(name).to_bytes() == domain.as_bytes() {
                        break;
                    }
                    chosen = (*chosen).next;
                }
            }
            let info = if chosen.is_null() {
                ptr::null_mut()
            } else {
                sys::fi_dupinfo(chosen)
            };
            sys::fi_freeinfo(list);
            if info.is_null() {
                return Err(no_provider("no such domain".into()));
            }
            info
        };
        let mut rail = Self {
            name: name.into(),
            provider: config.provider.clone(),
            info,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
            address: Vec::new(),
            mr_mode: MrMode {
                local: false,
                virt_addr: false,
                prov_key: false,
                endpoint: false,
            },
            manual_progress: false,
            limits: FabricLimits::UNLIMITED,
            registrations: Mutex::new(HashMap::new()),
            local: RwLock::new(HashMap::new()),
            tagged_immediates: false,
            remotely_accessible: AtomicU32::new(0),
            remote_regions: RwLock::new(HashMap::new()),
            next_lkey: AtomicU32::new(1),
            staged: Staging::default(),
            immediates: Mutex::new(HashMap::new()),
            fabric_taken: AtomicBool::new(false),
        };
        // On an error, `rail`'s Drop closes what was opened.
        rail.open_parts()?;
        warn_of_a_slow_connection_check(&rail.provider);
        Ok(Arc::new(rail))
    }

    fn open_parts(&mut self) -> Result<(), OfiError> {
        // SAFETY: every object is opened from the one before it, as libfabric requires, and
        // stored at once so that Drop closes it; `info` stays valid for the rail's life.
        unsafe {
            let info = &*self.info;
            let mode = (*info.domain_attr).mr_mode as u32;
            self.mr_mode = MrMode {
                local: mode & sys::FI_MR_LOCAL != 0,
                virt_addr: mode & sys::FI_MR_VIRT_ADDR != 0,
                prov_key: mode & sys::FI_MR_PROV_KEY != 0,
                endpoint: mode & sys::FI_MR_ENDPOINT != 0,
            };
            self.manual_progress =
                (*info.domain_attr).data_progress == sys::fi_progress_FI_PROGRESS_MANUAL;
            self.tagged_immediates = (*info.domain_attr).cq_data_size >= 8;
            // Registering memory from application threads beside the poller needs it.
            if (*info.domain_attr).threading != sys::fi_threading_FI_THREAD_SAFE {
                return Err(OfiError::NoProvider {
                    provider: self.provider.clone(),
                    domain: None,
                    reason: "its domain is not thread-safe (FI_THREAD_SAFE)".into(),
                });
            }
            let send_queue = (*info.tx_attr).size.max(1);
            self.limits = FabricLimits {
                send_queue,
                completion_queue: COMPLETION_QUEUE,
            };
            check(
                "fi_fabric",
                i64::from(sys::railyard_fi_fabric(
                    info.fabric_attr,
                    &mut self.fabric,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_domain",
                i64::from(sys::railyard_fi_domain(
                    self.fabric,
                    self.info,
                    &mut self.domain,
                    ptr::null_mut(),
                )),
            )?;
            let mut cq_attr = sys::fi_cq_attr {
                size: COMPLETION_QUEUE,
                format: sys::fi_cq_format_FI_CQ_FORMAT_DATA,
                wait_obj: sys::fi_wait_obj_FI_WAIT_NONE,
                ..Default::default()
            };
            check(
                "fi_cq_open",
                i64::from(sys::railyard_fi_cq_open(
                    self.domain,
                    &mut cq_attr,
                    &mut self.cq,
                    ptr::null_mut(),
                )),
            )?;
            let mut av_attr = sys::fi_av_attr {
                type_: sys::fi_av_type_FI_AV_TABLE,
                count: ADDRESS_VECTOR,
                ..Default::default()
            };
            check(
                "fi_av_open",
                i64::from(sys::railyard_fi_av_open(
                    self.domain,
                    &mut av_attr,
                    &mut self.av,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_endpoint",
                i64::from(sys::railyard_fi_endpoint(
                    self.domain,
                    self.info,
                    &mut self.ep,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_ep_bind(av)",
                i64::from(sys::railyard_fi_ep_bind(self.ep, &mut (*self.av).fid, 0)),
            )?;
            check(
                "fi_ep_bind(cq)",
                i64::from(sys::railyard_fi_ep_bind(
                    self.ep,
                    &mut (*self.cq).fid,
                    u64::from(sys::FI_TRANSMIT | sys::FI_RECV),
                )),
            )?;
            check("fi_enable", i64::from(sys::railyard_fi_enable(self.ep)))?;
            let mut len = 0usize;
            // The first call says how long the address is.
            let _ = sys::railyard_fi_getname(self.ep, ptr::null_mut(), &mut len);
            let mut address = vec![0u8; len.max(1)];
            check(
                "fi_getname",
                i64::from(sys::railyard_fi_getname(
                    self.ep,
                    address.as_mut_ptr().cast(),
                    &mut len,
                )),
            )?;
            address.truncate(len);
            self.address = address;
        }
        Ok(())
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provider it runs.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Its domain's name.
    pub fn domain(&self) -> String {
        // SAFETY: `info` is valid for the rail's life; the name is a NUL-terminated string.
        unsafe {
            let name = (*(*self.info).domain_attr).name;
            if name.is_null() {
                String::new()
            } else {
                CStr::from_ptr(name).to_string_lossy().into_owned()
            }
        }
    }

    /// Its endpoint's address, as peers insert it into their address vectors.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Work the rail holds at once.
    pub fn limits(&self) -> FabricLimits {
        self.limits
    }

    /// Whether peers' transfers progress only while this side reads its completion queue.
    pub fn manual_progress(&self) -> bool {
        self.manual_progress
    }

    fn registrations(&self) -> MutexGuard<'_, HashMap<u32, Registered>> {
        self.registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `[addr, addr + len)` with `access`.
    ///
    /// # Errors
    /// [`OfiError::BadRange`] for an empty range, [`OfiError::Call`] when the provider
    /// refuses it, [`OfiError::KeyTooWide`] when its key does not fit 32 bits.
    ///
    /// # Safety
    /// The range must stay mapped until [`Self::deregister`] returns for it (or the rail is
    /// dropped), and nothing else may assume its contents while peers may write it.
    pub unsafe fn register(
        &self,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryRegion, OfiError> {
        let size = usize::try_from(len).map_err(|_| OfiError::BadRange { addr, len })?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(OfiError::BadRange { addr, len });
        }
        let mut flags = u64::from(sys::FI_WRITE);
        if access.contains(Access::LOCAL_WRITE) {
            flags |= u64::from(sys::FI_READ);
        }
        if access.contains(Access::REMOTE_WRITE) {
            flags |= u64::from(sys::FI_REMOTE_WRITE);
        }
        if access.contains(Access::REMOTE_READ) {
            flags |= u64::from(sys::FI_REMOTE_READ);
        }
        let mut mr = ptr::null_mut();
        // Keys railyard picks are random: one already in use is drawn again.
        let mut attempts = 0;
        let registered = loop {
            let requested_key = if self.mr_mode.prov_key {
                0
            } else {
                // Drawn from the kernel for each registration: no key says anything of another.
                u64::from(crate::entropy::random_u64() as u32)
            };
            // SAFETY: the caller keeps the range mapped while registered; `mr` is closed on
            // every error path below and otherwise kept until `deregister`.
            let code = unsafe {
                sys::railyard_fi_mr_reg(
                    self.domain,
                    addr as *const c_void,
                    size,
                    flags,
                    0,
                    requested_key,
                    0,
                    &mut mr,
                    ptr::null_mut(),
                )
            };
            attempts += 1;
            let taken = i64::from(code) == -i64::from(sys::FI_ENOKEY);
            if !taken || self.mr_mode.prov_key || attempts == 8 {
                break check("fi_mr_reg", i64::from(code));
            }
        };
        registered?;
        // SAFETY: as above; `mr` was registered just now.
        unsafe {
            let bound = if self.mr_mode.endpoint {
                check(
                    "fi_mr_bind",
                    i64::from(sys::railyard_fi_mr_bind(mr, &mut (*self.ep).fid, 0)),
                )
                .and_then(|()| check("fi_mr_enable", i64::from(sys::railyard_fi_mr_enable(mr))))
            } else {
                Ok(())
            };
            let key = sys::railyard_fi_mr_key(mr);
            let key =
                bound.and_then(|()| u32::try_from(key).map_err(|_| OfiError::KeyTooWide { key }));
            let rkey = match key {
                Ok(rkey) => rkey,
                Err(error) => {
                    sys::railyard_fi_close(&mut (*mr).fid);
                    return Err(error);
                }
            };
            let lkey = self.next_lkey.fetch_add(1, Ordering::Relaxed);
            let region = MemoryRegion {
                addr,
                len,
                lkey,
                rkey,
                access,
            };
            let desc = if self.mr_mode.local {
                sys::railyard_fi_mr_desc(mr) as usize
            } else {
                0
            };
            self.local
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(lkey, LocalRegistration { region, desc });
            if access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_READ) {
                self.remotely_accessible.fetch_add(1, Ordering::Relaxed);
            }
            self.registrations().insert(lkey, Registered { mr, region });
            Ok(region)
        }
    }

    /// Withdraws the registration of `region`: peers' requests naming its key fail from now
    /// on. The caller makes sure no request of this process still uses it locally.
    ///
    /// # Errors
    /// [`OfiError::NotRegistered`] when it is not registered here.
    pub fn deregister(&self, region: &MemoryRegion) -> Result<(), OfiError> {
        let mut registrations = self.registrations();
        let registered = registrations
            .get(&region.lkey)
            .ok_or(OfiError::NotRegistered { lkey: region.lkey })?;
        // SAFETY: the registration was made by `register` and is closed once: it is
        // forgotten below only once the close succeeded (a failed close leaves it live, and
        // registered here).
        let code = unsafe { sys::railyard_fi_close(&mut (*registered.mr).fid) };
        check("fi_close(mr)", i64::from(code))?;
        let access = registered.region.access;
        registrations.remove(&region.lkey);
        drop(registrations);
        self.local
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&region.lkey);
        if access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_READ) {
            self.remotely_accessible.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether peers address registered memory by virtual address (`FI_MR_VIRT_ADDR`);
    /// otherwise by offset from the region's start, which the poller computes from what
    /// [`Self::learn_remote_regions`] said.
    pub fn virt_addr(&self) -> bool {
        self.mr_mode.virt_addr
    }

    /// The regions the peer at `address` registered on its rail, as (rkey, first byte,
    /// length, what peers may do): replaces what was known of that peer. A request to that
    /// peer naming a key it did not announce, a range outside the region, or an operation the
    /// region does not allow, fails with REM_ACCESS_ERR before it is posted: the target never
    /// sees it. (With `tcp;ofi_rxm` 1.17 a request the target
    /// refuses closes the connection between the two endpoints for good.) Without
    /// `FI_MR_VIRT_ADDR` requests to a peer that announced nothing fail the same way, as
    /// their offsets cannot be known. `owner` names who announced them (its incarnation).
    pub fn learn_remote_regions(
        &self,
        address: &[u8],
        owner: u64,
        regions: impl IntoIterator<Item = (u32, u64, u64, Access)>,
    ) {
        let regions = regions
            .into_iter()
            .map(|(rkey, base, len, access)| (rkey, (base, len, access)))
            .collect();
        self.remote_regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(address.to_vec(), AnnouncedRegions { owner, regions });
    }

    /// Forgets what `owner` announced at `address` (nothing, if a newer owner's regions are
    /// there now).
    pub fn forget_remote_regions(&self, address: &[u8], owner: u64) {
        let mut known = self
            .remote_regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if known
            .get(address)
            .is_some_and(|announced| announced.owner == owner)
        {
            known.remove(address);
        }
    }

    /// Peer addresses whose regions this rail knows.
    pub fn known_peers(&self) -> usize {
        self.remote_regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Keeps the immediates peers send with `tag` (a target's side of one connection) until
    /// [`Self::take_immediates`] takes them; false (and nothing changes) when the tag is
    /// already open for another connection.
    pub fn open_immediates(&self, tag: u32) -> bool {
        let mut open = self
            .immediates
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if open.contains_key(&tag) {
            return false;
        }
        open.insert(tag, Vec::new());
        true
    }

    /// Stops keeping immediates with `tag`, dropping those not taken.
    pub fn close_immediates(&self, tag: u32) {
        self.immediates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&tag);
    }

    /// Appends the immediates that arrived with `tag`, oldest first.
    pub fn take_immediates(&self, tag: u32, out: &mut Vec<u32>) {
        if let Some(arrived) = self
            .immediates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&tag)
        {
            out.append(arrived);
        }
    }

    /// An immediate arrived (the poller): kept if its tag is open.
    pub(crate) fn deliver_immediate(&self, data: u64) {
        let (tag, imm) = ((data >> 32) as u32, data as u32);
        if let Some(arrived) = self
            .immediates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&tag)
        {
            arrived.push(imm);
        }
    }

    /// Stages `peer` for `endpoint` at `epoch`: the poller's next connect for exactly that
    /// endpoint and epoch inserts its address.
    pub fn stage(&self, endpoint: EndpointId, epoch: Epoch, peer: OfiPeer) {
        self.staged.stage(endpoint, epoch, peer);
    }
}

/// A seed for the keys railyard picks: unpredictable enough that keys are not sequential
/// across processes.
impl Drop for OfiRail {
    fn drop(&mut self) {
        // SAFETY: each object is closed once, children before their parents (registrations
        // and the endpoint before the address vector and completion queue, those before the
        // domain, the domain before the fabric); null ones were never opened.
        unsafe {
            for (_, registered) in self.registrations().drain() {
                sys::railyard_fi_close(&mut (*registered.mr).fid);
            }
            if !self.ep.is_null() {
                sys::railyard_fi_close(&mut (*self.ep).fid);
            }
            if !self.av.is_null() {
                sys::railyard_fi_close(&mut (*self.av).fid);
            }
            if !self.cq.is_null() {
                sys::railyard_fi_close(&mut (*self.cq).fid);
            }
            if !self.domain.is_null() {
                sys::railyard_fi_close(&mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                sys::railyard_fi_close(&mut (*self.fabric).fid);
            }
            sys::fi_freeinfo(self.info);
        }
    }
}
