//! How an engine reaches its peers: opening one with an endpoint on every rail (or many at
//! once: [`Engine::warmup`]), looking a name up in the directory, and the notifications sent
//! to them and taken from them.

use std::net::ToSocketAddrs;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use railyard_control::{EndpointView, Notification, Phase, SegmentDescriptor};
use railyard_dataplane::Batch;

use super::error::PeerError;
use super::peer::Peer;
use super::state::Engine;

/// Opens [`Engine::warmup`] runs at once: as many handshakes as a target admits before their
/// Hello by default ([`Policy::max_handshakes`](railyard_control::Policy::max_handshakes)).
pub const WARMUP_PARALLEL: usize = 64;

/// One target of [`Engine::warmup`]: what opening it gave, and how long that took.
#[derive(Debug)]
pub struct Warmed {
    /// The target as given (`host:port` or a segment name).
    pub target: String,
    /// The peer, or why it could not be opened.
    pub result: Result<Peer, PeerError>,
    /// How long its open took (its handshakes and queue pairs on every rail).
    pub took: Duration,
}

impl Engine {
    /// Opens every target at once, [`WARMUP_PARALLEL`] at a time, before traffic needs
    /// them: a cluster's peers in about the time of the slowest few instead of one after
    /// the other. Answers one [`Warmed`] per target, in the order given; a target that
    /// cannot be opened fails alone.
    pub fn warmup(&self, targets: &[&str]) -> Vec<Warmed> {
        self.warmup_with(targets, WARMUP_PARALLEL)
    }

    /// [`Self::warmup`] with at most `parallel` opens at once (at least one).
    pub fn warmup_with(&self, targets: &[&str], parallel: usize) -> Vec<Warmed> {
        let next = AtomicUsize::new(0);
        let done: Mutex<Vec<(usize, Warmed)>> = Mutex::new(Vec::with_capacity(targets.len()));
        let workers = parallel.clamp(1, targets.len().max(1));
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&target) = targets.get(index) else {
                            return;
                        };
                        let started = Instant::now();
                        let result = self.open(target);
                        let warmed = Warmed {
                            target: target.to_string(),
                            result,
                            took: started.elapsed(),
                        };
                        done.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push((index, warmed));
                    }
                });
            }
        });
        let mut done = done
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        done.sort_unstable_by_key(|(index, _)| *index);
        done.into_iter().map(|(_, warmed)| warmed).collect()
    }

    /// Connects to the engine at `target` — `host:port`, or with a directory, a segment
    /// name — with an endpoint on every local rail, its descriptor fetched. Waits for the
    /// queue pairs (up to the connect timeout).
    ///
    /// # Errors
    /// [`PeerError`] when the address is bad, the name unknown, the peer cannot be reached
    /// in time, or the process answering is not the one asked for (the directory's record
    /// is stale, or it restarted while being opened).
    pub fn open(&self, target: &str) -> Result<Peer, PeerError> {
        let resolved;
        let (target, expected) = if target.contains(':') {
            (target, None)
        } else {
            let descriptor = self.inner.directory.resolve(target)?;
            resolved = descriptor.handshake_addr;
            (resolved.as_str(), Some(descriptor.incarnation))
        };
        let addr = target
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| PeerError::BadAddress {
                name: target.to_string(),
            })?;
        let unreachable = |reason: String| PeerError::Unreachable { addr, reason };
        let first = self
            .inner
            .control
            .connect(addr, 0, 0)
            .map_err(|error| unreachable(error.to_string()))?;
        let incarnation = first.key.peer;
        if let Some(expected) = expected.filter(|&expected| expected != incarnation) {
            // Not the process asked for: nothing is kept of it.
            let _ = self.inner.control.retire(&first);
            return Err(unreachable(format!(
                "the directory names incarnation {expected} there, but {incarnation} answers: \
                 the record is stale (look the name up again)"
            )));
        }
        let started = Instant::now();
        if !self.wait_connected(&first, started) {
            return Err(unreachable(format!(
                "no queue pair within the connect timeout ({:?})",
                first.phase()
            )));
        }
        let remote_rails = first.descriptor().map_or(1, |d| d.rails.len().max(1));
        let mut views = vec![first];
        for rail in 1..self.rails() {
            let view = self
                .inner
                .control
                .connect(addr, rail as u16, (rail % remote_rails) as u16)
                .map_err(|error| unreachable(error.to_string()))?;
            if view.key.peer != incarnation {
                for opened in views.iter().chain([&view]) {
                    let _ = self.inner.control.retire(opened);
                }
                return Err(unreachable(format!(
                    "the process there changed while it was being opened ({incarnation}, then \
                     {}); open it again",
                    view.key.peer
                )));
            }
            if !self.wait_connected(&view, started) {
                return Err(unreachable(format!("rail {rail} did not connect")));
            }
            views.push(view);
        }
        Ok(Peer {
            addr,
            views,
            engine: self.incarnation(),
        })
    }

    /// Waits for `view`'s queue pair: for the connect timeout, and past it for as long as
    /// its handshake still runs — which, past the connect timeout, means it waits its turn at
    /// a busy target or behind this side's other handshakes — up to the queue timeout.
    fn wait_connected(&self, view: &EndpointView, started: Instant) -> bool {
        let patience = started + self.inner.connect_timeout + self.inner.handshake_queue_timeout;
        let mut deadline = started + self.inner.connect_timeout;
        loop {
            if view.wait_ready(deadline) {
                return true;
            }
            let now = Instant::now();
            if view.phase() != Phase::Connecting || now >= patience {
                return false;
            }
            deadline = (now + self.inner.connect_timeout).min(patience);
        }
    }

    /// What the segment named `name` last published in the directory (its incarnation,
    /// address, rails and regions), without connecting to it. A segment with a cluster secret
    /// publishes no regions: peers get them through the authenticated handshake, not from
    /// whoever can read the directory.
    ///
    /// # Errors
    /// [`PeerError::UnknownName`] when there is no directory or no such live segment.
    pub fn lookup(&self, name: &str) -> Result<SegmentDescriptor, PeerError> {
        self.inner.directory.resolve(name)
    }

    /// Sends `bytes` to `peer` now.
    ///
    /// # Errors
    /// [`PeerError::Control`] when the control plane has stopped.
    pub fn notify(&self, peer: &Peer, bytes: Vec<u8>) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .notify(peer.addr, peer.incarnation(), bytes, None)?)
    }

    /// Sends `bytes` to `peer` once `batch` has completed successfully (all its data is in
    /// place before the notification leaves), and not at all if it failed.
    ///
    /// # Errors
    /// [`PeerError::Control`] when the control plane has stopped or `bytes` is larger than
    /// one notification carries.
    pub fn notify_after(
        &self,
        peer: &Peer,
        bytes: Vec<u8>,
        batch: &Batch,
    ) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .notify(peer.addr, peer.incarnation(), bytes, Some(batch.clone()))?)
    }

    pub(crate) fn signal_after(
        &self,
        peer: &Peer,
        value: u32,
        batch: &Batch,
    ) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .signal(peer.views.clone(), value, batch.clone())?)
    }

    /// Takes the notifications peers sent, oldest first.
    pub fn drain_notifications(&self) -> Vec<Notification> {
        self.inner.shared.drain_notifications()
    }

    /// Takes the notifications peers sent, oldest first, waiting until at least one has
    /// arrived or `deadline` passes (then it returns none).
    pub fn wait_notifications(&self, deadline: Instant) -> Vec<Notification> {
        self.inner.shared.wait_notifications(deadline)
    }
}
