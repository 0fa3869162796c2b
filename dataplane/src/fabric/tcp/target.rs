//! [`TcpTarget`]: the control plane's handle of a target queue pair — how one is created and
//! advertised, how its immediates are taken, and how its close is acknowledged.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::attachment::TcpAttachment;
use super::device::TcpDevice;
use super::link::{TargetLink, TargetShared};
use crate::fabric::{QpInfo, QpNum};
use crate::ring::{self, Consumer};

/// Immediates a target queue pair holds for its owner before the connection waits.
const IMMEDIATE_QUEUE: usize = 4096;

/// How often [`TargetClosed::wait`] looks.
const ACKNOWLEDGMENT_POLL: Duration = Duration::from_micros(200);

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

impl TcpDevice {
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
        let addr = SocketAddr::new(advertise, self.local_addr().port());
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

/// An unspecified address stands for "whichever address the peer reached us at".
pub fn is_unspecified(ip: IpAddr) -> bool {
    ip == IpAddr::V4(Ipv4Addr::UNSPECIFIED) || ip == IpAddr::V6(Ipv6Addr::UNSPECIFIED)
}
