//! [`TcpDevice`]: one rail's TCP device — its data port, the registrations it serves (its
//! soft device's), the numbers of its queue pairs, and the initiators' queue pairs it dials
//! and stages for its poller.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::attachment::TcpAttachment;
use super::config::TcpConfig;
use super::error::TcpError;
use super::link::TargetLink;
use super::qp::{TcpPreparedQp, TcpQp};
use super::stats::{ServedCounters, ServedStats};
use super::sys;
use super::wire::Hello;
use crate::fabric::faults::FaultHandle;
use crate::fabric::soft::SoftDevice;
use crate::fabric::staging::Staging;
use crate::fabric::{QpInfo, QpNum};
use crate::{EndpointId, Epoch};

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

/// One rail's TCP device. Cheap to clone; `Send + Sync`: the control plane connects and
/// hands out queue pairs while the rail's poller drives the [`TcpFabric`](super::TcpFabric).
/// See the [module docs](super).
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
        self.0.served.stats()
    }

    pub(super) fn served_counters(&self) -> &ServedCounters {
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

    pub(super) fn next_num(&self) -> QpNum {
        QpNum::high(self.0.next_qp.fetch_add(1, Ordering::Relaxed))
    }

    pub(super) fn info(num: QpNum) -> QpInfo {
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

    /// Hands a connected queue pair to this rail's poller: its next `connect` for
    /// `endpoint` at `epoch` adopts it. One staged earlier for the endpoint is dropped.
    pub fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: TcpQp) {
        self.0.staged.stage(endpoint, epoch, qp);
    }

    /// Whether a queue pair is staged for `endpoint` at exactly `epoch`.
    pub fn has_staged(&self, endpoint: EndpointId, epoch: Epoch) -> bool {
        self.0.staged.is_staged(endpoint, epoch)
    }

    pub(super) fn staged(&self) -> &Staging<TcpQp> {
        &self.0.staged
    }

    pub(super) fn pending(&self) -> MutexGuard<'_, HashMap<u64, TargetLink>> {
        self.0
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn soft(&self) -> &SoftDevice {
        &self.0.soft
    }

    pub(super) fn listener(&self) -> &TcpListener {
        &self.0.listener
    }
}
