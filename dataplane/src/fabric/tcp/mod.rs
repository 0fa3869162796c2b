//! The TCP fabric: the soft fabric's one-sided semantics between hosts without RDMA.
//!
//! A [`TcpDevice`] belongs to one rail. It serves the registrations of that rail's
//! [`SoftDevice`] (same keys, same live region table, same fault plan), so one registration
//! is reachable over either fabric, and it listens for data connections on one port.
//!
//! # Queue pairs
//! A queue pair is one TCP connection. The initiator's side ([`TcpDevice::create_qp`],
//! [`TcpDevice::connect`]) starts a non-blocking connection to the target's data port (the
//! control thread never waits on a peer) and the control plane stages it for the poller, as
//! with the other fabrics; the poller's first bytes on it are a hello naming the token the
//! target handed out at ConnectQp ([`TcpDevice::create_target`]). The target's side is served by the
//! target rail's own poller ([`TcpFabric`], through
//! [`Fabric::serve`](crate::fabric::Fabric::serve)), never by a thread of its own; the
//! control plane keeps a [`TcpTarget`] handle, which takes the WRITE_WITH_IMM immediates
//! and closes the connection when dropped or [closed](TcpTarget::close) (which also returns
//! the poller's acknowledgment).
//!
//! # Work requests
//! A WRITE is a header (rkey, remote address, length, work-request id) then the payload,
//! sent straight from the registered source; the target checks the header against its live
//! region table and receives the payload straight into the region — no intermediate copy in
//! user space on either side. A READ is a header answered by a reply header and the data,
//! sent straight from the region and received straight into the local one. Every request is
//! answered, in order; a WRITE completes at the initiator only once the target has applied
//! it, so a completed WRITE is visible to any later READ.
//!
//! # Statuses
//! As the other fabrics: LOC_PROT_ERR / LOC_LEN_ERR from the initiator's own checks,
//! REM_ACCESS_ERR from the target's, RETRY_EXC_ERR when the connection breaks or the peer
//! sends nothing for [`TcpConfig::peer_timeout`] while work is outstanding, WR_FLUSH_ERR for
//! everything outstanding or posted after an error. A connection that breaks with nothing
//! outstanding raises [`AsyncEvent::QpFatal`](crate::fabric::AsyncEvent::QpFatal) so the
//! control plane reconnects before the next transfer needs it.
//!
//! # Nothing moves after it is reported
//! - A target that answers an error reads nothing more from that connection — no header, no
//!   payload: it sends the replies it owes (the error last) and closes. What the initiator
//!   will see flushed is never executed.
//! - A target queue pair whose owner closed it ([`TcpTarget`] dropped or
//!   [closed](TcpTarget::close)) executes nothing more: the poller looks before every request
//!   it starts, every payload chunk it receives and every READ reply it sends, and closes the
//!   connection, so the kernel discards whatever was buffered. [`TcpTarget::close`]'s
//!   [`TargetClosed`] tells when that happened.
//! - An initiator's queue pair that goes to ERR (an error, or
//!   [`Fabric::retire`](crate::fabric::Fabric::retire)) closes its connection abortively: the
//!   kernel sends a reset and drops what it had not sent yet. What the peer's kernel had
//!   already received may still be applied by a target that keeps serving it; closing the
//!   target queue pair is what ends that.
//! - Withdrawn registrations are never touched again. Each side checks the key against the
//!   live region table ([`SoftDevice::deregister`] withdraws it) not only when a request is
//!   judged but again right before every system call that reads or writes registered memory:
//!   every vectored send of WRITE payloads and READ replies, every receive of a WRITE's
//!   payload or a READ's data. A withdrawal fails the request that names it — LOC_PROT_ERR
//!   at the initiator; REM_ACCESS_ERR at the target, or a closed connection (RETRY_EXC_ERR)
//!   once a READ reply's data has started — and the queue pair goes to ERR without moving
//!   the rest; a payload received in part stays partial. So once `deregister` has returned
//!   and this rail's poller has finished the round it was in, this fabric never reads or
//!   writes the region again.

mod fabric;
mod sys;
mod wire;

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use fabric::{REQUESTS_PER_SEND, TcpFabric};

pub use super::TCP_QP_BIT;
use super::faults::FaultHandle;
use super::soft::SoftDevice;
use super::staging::Staging;
use super::{QpInfo, QpNum};
use crate::ring::{self, Consumer, Producer};
use crate::{EndpointId, Epoch};
use wire::Hello;

/// Whether `qp` is a TCP queue pair's number.
pub fn is_tcp_qp(qp: QpNum) -> bool {
    qp.0 & TCP_QP_BIT != 0
}

/// Immediates a target queue pair holds for its owner before the connection waits.
const IMMEDIATE_QUEUE: usize = 4096;

/// How often [`TargetClosed::wait`] looks.
const ACKNOWLEDGMENT_POLL: Duration = Duration::from_micros(200);

/// How a TCP device behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Longest outstanding work may wait without the peer sending or taking a byte before
    /// it fails with RETRY_EXC_ERR.
    pub peer_timeout: Duration,
    /// Longest a dial (connect and hello) may take; also how long an accepted connection
    /// may take to say hello.
    pub connect_timeout: Duration,
    /// SO_SNDBUF / SO_RCVBUF of data connections; `None` keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
    /// Work requests a queue pair queues before `post` refuses more.
    pub send_queue_depth: usize,
    /// Whether a raw byte stream (a sink hello: the bench's ceiling across hosts) is read
    /// and discarded. Off by default: it is not bound to any handshake, and serving it costs
    /// a 64 MiB buffer.
    pub accept_sinks: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            peer_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            socket_buffer: None,
            send_queue_depth: 16 * 1024,
            accept_sinks: false,
        }
    }
}

/// Why a TCP-fabric operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// The data port could not be opened.
    #[error("cannot listen for TCP fabric connections on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The target's data port could not be reached.
    #[error("cannot connect to the TCP fabric port {addr}: {source}")]
    Connect {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A peer's attachment bytes are malformed.
    #[error("malformed TCP fabric attachment: {0}")]
    Attachment(String),
    /// No connected queue pair was staged for the endpoint at that epoch.
    #[error("no connected TCP queue pair is staged for endpoint {endpoint:?} at {epoch}")]
    NotStaged {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
    },
}

/// What a queue pair's side tells the peer beyond its [`QpInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpAttachment {
    /// An initiator: it dials, so it has nothing to say but which fabric it is.
    Initiator,
    /// A target: where to dial and the token to say in the hello.
    Target {
        /// The target rail's data port.
        addr: SocketAddr,
        /// Names the target queue pair.
        token: u64,
    },
}

const ATTACHMENT_MAGIC: [u8; 4] = *b"RYTC";
const INITIATOR: u8 = 1;
const TARGET: u8 = 2;

impl TcpAttachment {
    /// Bytes of an encoded target attachment (an initiator's is the first 5).
    pub const TARGET_LEN: usize = 4 + 1 + 1 + 16 + 2 + 8;

    /// Whether `bytes` are a TCP attachment (rather than another fabric's).
    pub fn is_tcp(bytes: &[u8]) -> bool {
        bytes.starts_with(&ATTACHMENT_MAGIC)
    }

    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = ATTACHMENT_MAGIC.to_vec();
        match *self {
            Self::Initiator => bytes.push(INITIATOR),
            Self::Target { addr, token } => {
                bytes.push(TARGET);
                let (family, ip) = match addr.ip() {
                    IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
                    IpAddr::V6(v6) => (6, v6.octets()),
                };
                bytes.push(family);
                bytes.extend_from_slice(&ip);
                bytes.extend_from_slice(&addr.port().to_le_bytes());
                bytes.extend_from_slice(&token.to_le_bytes());
            }
        }
        bytes
    }

    /// Decodes the wire form.
    ///
    /// # Errors
    /// [`TcpError::Attachment`] naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, TcpError> {
        let bad = |what: &str| TcpError::Attachment(what.to_string());
        if !Self::is_tcp(bytes) {
            return Err(bad("not a TCP attachment (bad magic)"));
        }
        match (bytes.get(4), bytes.len()) {
            (Some(&INITIATOR), 5) => Ok(Self::Initiator),
            (Some(&TARGET), Self::TARGET_LEN) => {
                let mut ip = [0; 16];
                ip.copy_from_slice(&bytes[6..22]);
                let ip = match bytes[5] {
                    4 => IpAddr::V4(
                        Ipv6Addr::from(ip)
                            .to_ipv4_mapped()
                            .ok_or_else(|| bad("an IPv4 address that is not IPv4-mapped"))?,
                    ),
                    6 => IpAddr::V6(Ipv6Addr::from(ip)),
                    other => return Err(bad(&format!("unknown address family {other}"))),
                };
                let port = u16::from_le_bytes([bytes[22], bytes[23]]);
                let mut token = [0; 8];
                token.copy_from_slice(&bytes[24..32]);
                Ok(Self::Target {
                    addr: SocketAddr::new(ip, port),
                    token: u64::from_le_bytes(token),
                })
            }
            (Some(&INITIATOR | &TARGET), len) => Err(bad(&format!(
                "{len} bytes is the wrong length for its kind"
            ))),
            (Some(other), _) => Err(bad(&format!("unknown kind {other}"))),
            (None, _) => Err(bad("no kind")),
        }
    }
}

/// An initiator's queue pair before it is connected.
#[derive(Debug)]
pub struct TcpPreparedQp {
    num: QpNum,
}

/// An initiator's queue pair, until its poller adopts it: a connection started without
/// waiting (the control thread never blocks on a peer), and the hello the poller sends
/// first once it is established.
#[derive(Debug)]
pub struct TcpQp {
    num: QpNum,
    stream: TcpStream,
    hello: [u8; wire::HELLO_LEN],
}

impl TcpQp {
    /// Its number.
    pub fn num(&self) -> QpNum {
        self.num
    }
}

/// What the control plane's target handle and the serving poller share.
#[derive(Debug, Default)]
struct TargetShared {
    /// The handle was dropped: the poller closes the connection.
    dropped: AtomicBool,
    /// Nothing serves the queue pair any more: its connection, if it had one, is closed
    /// (set by [`TargetLink`]'s drop).
    closed: AtomicBool,
}

/// A target queue pair's serving end, held by whoever may serve it: the device's pending
/// table until the initiator's hello names it, then the connection the poller serves.
/// Dropping it acknowledges the close to the owner: nothing can serve the queue pair any
/// more (a served connection drops it only after its socket, see `Served`).
#[derive(Debug)]
struct TargetLink {
    shared: Arc<TargetShared>,
    immediates: Producer<u32>,
}

impl Drop for TargetLink {
    fn drop(&mut self) {
        // Release: whatever the poller did to the queue pair's memory happens before an
        // owner's acquiring `TargetClosed::wait` sees this.
        self.shared.closed.store(true, Ordering::Release);
    }
}

/// The control plane's handle of a target queue pair: the rail's poller serves the
/// connection; this takes the immediates it received. Dropping it closes the connection;
/// [`close`](Self::close) does too and returns the poller's acknowledgment.
#[derive(Debug)]
pub struct TcpTarget {
    device: TcpDevice,
    num: QpNum,
    token: u64,
    shared: Arc<TargetShared>,
    immediates: Consumer<u32>,
}

impl TcpTarget {
    /// Its number.
    pub fn num(&self) -> QpNum {
        self.num
    }

    /// Appends the immediates of the WRITE_WITH_IMM requests applied since the last call to
    /// `out`, oldest first.
    pub fn take_immediates(&mut self, out: &mut Vec<u32>) {
        self.immediates.pop_into(out, usize::MAX);
    }

    /// Closes the queue pair, as dropping it does: the poller executes nothing more from
    /// its connection — it looks before every request, payload chunk and READ reply — and
    /// closes it, so the kernel discards what was buffered. The returned handle tells when
    /// that is done.
    pub fn close(self) -> TargetClosed {
        let shared = self.shared.clone();
        drop(self);
        TargetClosed { shared }
    }
}

impl Drop for TcpTarget {
    fn drop(&mut self) {
        // Release: pairs with the poller's Acquire before each step; the acknowledgment is
        // what orders the poller's work before the owner's.
        self.shared.dropped.store(true, Ordering::Release);
        // Still pending (no connection named it yet): dropping the link here acknowledges
        // at once, and a hello naming the token later is refused.
        drop(self.device.pending().remove(&self.token));
    }
}

/// The acknowledgment of a closed target queue pair ([`TcpTarget::close`]).
#[derive(Debug)]
pub struct TargetClosed {
    shared: Arc<TargetShared>,
}

impl TargetClosed {
    /// Waits until nothing serves the queue pair any more — its poller closed the
    /// connection, or never had one, or its fabric was dropped — or until `deadline`
    /// (a stopped poller never acknowledges). True when acknowledged: from then on nothing
    /// of the connection reads or writes this process's memory, and everything it wrote is
    /// visible to the caller.
    pub fn wait(&self, deadline: Instant) -> bool {
        loop {
            // Acquire: pairs with the Release in `TargetLink`'s drop.
            if self.shared.closed.load(Ordering::Acquire) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep((deadline - now).min(ACKNOWLEDGMENT_POLL));
        }
    }
}

#[derive(Debug)]
struct DeviceInner {
    name: String,
    config: TcpConfig,
    soft: SoftDevice,
    listener: TcpListener,
    local_addr: SocketAddr,
    next_qp: AtomicU32,
    staged: Staging<TcpQp>,
    pending: Mutex<HashMap<u64, TargetLink>>,
    served: ServedCounters,
}

/// What this device's target side carried out for initiators, counted by the poller that
/// serves its connections (one writer).
#[derive(Debug, Default)]
pub(crate) struct ServedCounters {
    writes: AtomicU64,
    write_bytes: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
}

impl ServedCounters {
    /// A WRITE (or WRITE_WITH_IMM) of `len` bytes landed in registered memory.
    pub(crate) fn wrote(&self, len: u32) {
        add(&self.writes, 1);
        add(&self.write_bytes, u64::from(len));
    }

    /// A READ of `len` bytes was checked and its data queued to go back.
    pub(crate) fn read(&self, len: u32) {
        add(&self.reads, 1);
        add(&self.read_bytes, u64::from(len));
    }
}

/// Relaxed load and store, no read-modify-write: the device's one poller is the only writer.
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// What a TCP device's target side carried out for initiators: WRITEs whose payload landed
/// in this process's registered memory, READs whose data it sent back. (Soft-fabric and RDMA
/// transfers are one-sided: the target's CPU never sees them, so only TCP counts them.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServedStats {
    /// WRITEs applied.
    pub writes: u64,
    /// Their bytes.
    pub write_bytes: u64,
    /// READs answered.
    pub reads: u64,
    /// Their bytes.
    pub read_bytes: u64,
}

/// One rail's TCP device. Cheap to clone; `Send + Sync`: the control plane connects and
/// hands out queue pairs while the rail's poller drives the [`TcpFabric`]. See the module
/// docs.
#[derive(Clone, Debug)]
pub struct TcpDevice(Arc<DeviceInner>);

impl TcpDevice {
    /// Opens the TCP side of `soft`'s rail: a data port on `bind` (port chosen by the
    /// system), serving `soft`'s registrations.
    ///
    /// # Errors
    /// [`TcpError::Listen`].
    pub fn open(soft: &SoftDevice, bind: IpAddr, config: TcpConfig) -> Result<Self, TcpError> {
        let addr = SocketAddr::new(bind, 0);
        let listen_error = |source| TcpError::Listen { addr, source };
        let listener = TcpListener::bind(addr).map_err(listen_error)?;
        listener.set_nonblocking(true).map_err(listen_error)?;
        let local_addr = listener.local_addr().map_err(listen_error)?;
        Ok(Self(Arc::new(DeviceInner {
            name: format!("{}+tcp", soft.name()),
            config,
            soft: soft.clone(),
            listener,
            local_addr,
            next_qp: AtomicU32::new(1),
            staged: Staging::default(),
            pending: Mutex::new(HashMap::new()),
            served: ServedCounters::default(),
        })))
    }

    /// What its target side carried out so far.
    pub fn served(&self) -> ServedStats {
        let served = &self.0.served;
        ServedStats {
            writes: served.writes.load(Ordering::Relaxed),
            write_bytes: served.write_bytes.load(Ordering::Relaxed),
            reads: served.reads.load(Ordering::Relaxed),
            read_bytes: served.read_bytes.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn served_counters(&self) -> &ServedCounters {
        &self.0.served
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Its configuration.
    pub fn config(&self) -> &TcpConfig {
        &self.0.config
    }

    /// Where its data port listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr
    }

    /// The rail's fault plan (shared with its soft device).
    pub fn faults(&self) -> FaultHandle {
        self.0.soft.faults()
    }

    fn next_num(&self) -> QpNum {
        let n = self.0.next_qp.fetch_add(1, Ordering::Relaxed) & (TCP_QP_BIT - 1);
        QpNum(TCP_QP_BIT | n)
    }

    fn info(num: QpNum) -> QpInfo {
        QpInfo {
            qp_num: num.0,
            lid: 0,
            gid: [0; 16],
            psn: 0,
            path_mtu: 4096,
        }
    }

    /// An initiator's queue pair and what the target needs to know of it.
    pub fn create_qp(&self) -> (TcpPreparedQp, QpInfo) {
        let num = self.next_num();
        (TcpPreparedQp { num }, Self::info(num))
    }

    /// Connects `qp` to the target that answered with `target`: starts a non-blocking
    /// connection to its data port and returns at once; the poller that adopts it sends the
    /// hello when the connection is up. A connection that fails or never comes up fails the
    /// queue pair's first requests (RETRY_EXC_ERR) or raises QP_FATAL, as a broken one does.
    ///
    /// # Errors
    /// [`TcpError::Connect`] when no connection can be started, or
    /// [`TcpError::Attachment`] when `target` is not a target's.
    pub fn connect(&self, qp: TcpPreparedQp, target: &TcpAttachment) -> Result<TcpQp, TcpError> {
        let TcpAttachment::Target { addr, token } = *target else {
            return Err(TcpError::Attachment(
                "the peer's side is an initiator's, not a target's".into(),
            ));
        };
        let connect_error = |source| TcpError::Connect { addr, source };
        let stream = sys::connect_nonblocking(addr).map_err(connect_error)?;
        sys::tune(&stream, self.0.config.socket_buffer).map_err(connect_error)?;
        Ok(TcpQp {
            num: qp.num,
            stream,
            hello: Hello::QueuePair { token }.encode(),
        })
    }

    /// A target queue pair for an initiator that will dial this device, advertised at
    /// `advertise` (the address the initiator reached this process at) and this device's
    /// port: the handle, its info and its attachment.
    pub fn create_target(&self, advertise: IpAddr) -> (TcpTarget, QpInfo, TcpAttachment) {
        let num = self.next_num();
        let token = loop {
            let token = crate::entropy::random_u64();
            if token != 0 && !self.pending().contains_key(&token) {
                break token;
            }
        };
        let shared = Arc::new(TargetShared::default());
        let (producer, consumer) = ring::channel(IMMEDIATE_QUEUE);
        self.pending().insert(
            token,
            TargetLink {
                shared: shared.clone(),
                immediates: producer,
            },
        );
        let addr = SocketAddr::new(advertise, self.0.local_addr.port());
        (
            TcpTarget {
                device: self.clone(),
                num,
                token,
                shared,
                immediates: consumer,
            },
            Self::info(num),
            TcpAttachment::Target { addr, token },
        )
    }

    /// Hands a connected queue pair to this rail's poller: its next `connect` for
    /// `endpoint` at `epoch` adopts it. One staged earlier for the endpoint is dropped.
    pub fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: TcpQp) {
        self.0.staged.stage(endpoint, epoch, qp);
    }

    /// Whether a queue pair is staged for `endpoint` at exactly `epoch`.
    pub fn has_staged(&self, endpoint: EndpointId, epoch: Epoch) -> bool {
        self.0.staged.is_staged(endpoint, epoch)
    }

    pub(crate) fn staged(&self) -> &Staging<TcpQp> {
        &self.0.staged
    }

    /// A fabric for this device's poller.
    ///
    /// # Errors
    /// When its epoll instance cannot be created.
    pub fn fabric(&self) -> io::Result<TcpFabric> {
        TcpFabric::new(self.clone())
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u64, TargetLink>> {
        self.0
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn soft(&self) -> &SoftDevice {
        &self.0.soft
    }
}

/// Dials `addr` within `timeout` and sends `hello`.
fn dial(addr: SocketAddr, timeout: Duration, hello: Hello) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(&hello.encode())?;
    stream.set_write_timeout(None)?;
    Ok(stream)
}

/// Opens a raw byte stream to a TCP device's data port, which the serving poller reads and
/// discards: the ceiling a benchmark compares the fabric with (same two processes, same
/// receiving thread, no protocol).
///
/// # Errors
/// When the port cannot be reached.
pub fn open_sink(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let stream = dial(addr, timeout, Hello::Sink)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// An unspecified address stands for "whichever address the peer reached us at".
pub fn is_unspecified(ip: IpAddr) -> bool {
    ip == IpAddr::V4(Ipv4Addr::UNSPECIFIED) || ip == IpAddr::V6(Ipv6Addr::UNSPECIFIED)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn attachments_round_trip_and_malformed_ones_are_named() {
        let v4 = TcpAttachment::Target {
            addr: "10.1.2.3:4567".parse().unwrap(),
            token: 0xABCD,
        };
        let v6 = TcpAttachment::Target {
            addr: "[fe80::1]:80".parse().unwrap(),
            token: 7,
        };
        for attachment in [TcpAttachment::Initiator, v4, v6] {
            let bytes = attachment.encode();
            assert!(TcpAttachment::is_tcp(&bytes));
            assert_eq!(TcpAttachment::decode(&bytes).unwrap(), attachment);
        }
        let error = |bytes: &[u8]| TcpAttachment::decode(bytes).unwrap_err().to_string();
        assert!(error(b"SOFT....").contains("magic"));
        assert!(error(b"RYTC").contains("no kind"));
        assert!(error(b"RYTC\x09").contains("unknown kind 9"));
        assert!(error(b"RYTC\x01\x00").contains("wrong length"));
        let mut bad_family = v4.encode();
        bad_family[5] = 5;
        assert!(error(&bad_family).contains("family 5"));
    }

    #[test]
    fn queue_pair_numbers_are_marked_as_tcp() {
        let soft = SoftDevice::open("t0", Default::default()).unwrap();
        let device =
            TcpDevice::open(&soft, IpAddr::V4(Ipv4Addr::LOCALHOST), TcpConfig::default()).unwrap();
        let (a, info) = device.create_qp();
        let (b, _, _) = device.create_target(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(is_tcp_qp(a.num) && is_tcp_qp(b.num()) && a.num != b.num());
        assert_eq!(info.qp_num, a.num.0);
        assert!(!is_tcp_qp(
            soft.create_qp(crate::fabric::Access::ALL).unwrap().num()
        ));
    }
}
