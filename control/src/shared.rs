//! What the control thread shares with the application and the pollers' re-prepare hooks:
//! the endpoint views (one per endpoint, read without locks on the data path), the
//! published regions, the notification queue and the counters. The control thread is the
//! only writer of views and counters.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use railyard_dataplane::{EndpointId, Epoch, FailReason, RepairCause, Reprepare, Slice};

use crate::descriptor::{RegionDescriptor, SegmentDescriptor};
use crate::endpoint::{EndpointKey, Incarnation, Phase};
use crate::warn::WarningKind;

/// An endpoint as the application and the re-prepare hook see it.
#[derive(Debug)]
pub struct EndpointView {
    /// Its id on its local rail's poller.
    pub id: EndpointId,
    /// Its key.
    pub key: EndpointKey,
    /// The peer's segment name.
    pub peer_name: String,
    /// The first epoch of this endpoint: older slices on this id were meant for a previous
    /// occupant.
    pub(crate) first_epoch: Epoch,
    /// The epoch whose queue pair the poller has (0: none yet).
    epoch: AtomicU64,
    /// Slices prepared for an epoch older than this fail `Revoked` (0: none): the peer
    /// revoked this side after they were prepared (its fence generation for us changed).
    revoked_below: AtomicU64,
    phase: AtomicU8,
    /// Its circuit is half-open (see [`Self::on_probation`]).
    probation: AtomicBool,
    /// Its queue pair was freed while it was idle (see [`Self::is_parked`]).
    parked: AtomicBool,
    /// Signalled after each new phase or epoch: [`Self::wait_ready`] sleeps on it.
    changed: Condvar,
    /// The lock `changed` is waited on with (it guards nothing but the wake-up).
    changed_lock: Mutex<()>,
    descriptor: RwLock<Option<Arc<SegmentDescriptor>>>,
    /// Bumped after each new descriptor: readers keep the one they have while it is equal
    /// (no lock on their hot path).
    descriptor_version: AtomicU64,
}

impl EndpointView {
    pub(crate) fn new(
        id: EndpointId,
        key: EndpointKey,
        peer_name: String,
        first_epoch: Epoch,
        descriptor: Option<Arc<SegmentDescriptor>>,
    ) -> Self {
        Self {
            id,
            key,
            peer_name,
            first_epoch,
            epoch: AtomicU64::new(0),
            revoked_below: AtomicU64::new(0),
            phase: AtomicU8::new(0),
            probation: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            changed: Condvar::new(),
            changed_lock: Mutex::new(()),
            descriptor: RwLock::new(descriptor),
            descriptor_version: AtomicU64::new(0),
        }
    }

    /// The epoch slices should be prepared for now, once a queue pair was handed over.
    pub fn epoch(&self) -> Option<Epoch> {
        match self.epoch.load(Ordering::Acquire) {
            0 => None,
            n => Some(Epoch::new(n)),
        }
    }

    /// Whether a slice prepared for `epoch` was prepared before the peer last revoked this
    /// side: it must never reach the peer.
    pub fn is_revoked(&self, epoch: Epoch) -> bool {
        epoch.get() < self.revoked_below.load(Ordering::Acquire)
    }

    /// The fence mark: slices prepared for an epoch below it fail `Revoked` (0: the peer
    /// never revoked this side). It only grows; a change means the peer put up a fence.
    pub fn revoked_below(&self) -> u64 {
        self.revoked_below.load(Ordering::Acquire)
    }

    /// The peer revoked this side before `epoch`'s queue pair was connected: every slice
    /// prepared for an older epoch is fenced off for good. Set before the queue pair is
    /// handed to the poller, so the poller re-prepares no older slice without seeing it.
    pub(crate) fn revoke_before(&self, epoch: Epoch) {
        self.revoked_below.fetch_max(epoch.get(), Ordering::AcqRel);
    }

    /// Where the endpoint stands.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Idle,
            1 => Phase::Connecting,
            2 => Phase::Ready,
            3 => Phase::Backoff,
            4 => Phase::CircuitOpen,
            _ => Phase::Retired,
        }
    }

    /// The peer's newest descriptor.
    pub fn descriptor(&self) -> Option<Arc<SegmentDescriptor>> {
        self.descriptor
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sleeps until the endpoint is ready or `deadline` passes (woken by each new phase or
    /// epoch, so thousands of waiting threads cost nothing while they wait).
    pub fn wait_ready(&self, deadline: Instant) -> bool {
        let mut guard = self
            .changed_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            if self.phase() == Phase::Ready && self.epoch().is_some() {
                return true;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            if left.is_zero() || self.phase() == Phase::Retired {
                return false;
            }
            guard = self
                .changed
                .wait_timeout(guard, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Wakes the threads in [`Self::wait_ready`] after a change: taking the lock first
    /// means a waiter either has not checked yet (and sees the change) or already sleeps.
    fn signal_change(&self) {
        drop(
            self.changed_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.changed.notify_all();
    }

    /// Whether its circuit is half-open: ready after a cooldown, no success yet. A
    /// submitter with another rail to the peer sends it work only as overflow, so that a
    /// link still dead fails little.
    pub fn on_probation(&self) -> bool {
        self.probation.load(Ordering::Acquire)
    }

    /// Whether its queue pair was freed while it was idle, to keep its rail within
    /// [`Policy::max_endpoints_per_rail`](crate::Policy::max_endpoints_per_rail): the next
    /// slice sent to it waits while it connects a new one.
    pub fn is_parked(&self) -> bool {
        self.parked.load(Ordering::Acquire)
    }

    pub(crate) fn set_parked(&self, parked: bool) {
        self.parked.store(parked, Ordering::Release);
    }

    /// Publishes the endpoint's phase and whether its circuit is half-open.
    pub(crate) fn publish(&self, phase: Phase, probation: bool) {
        self.probation.store(probation, Ordering::Release);
        self.set_phase(phase);
    }

    pub(crate) fn set_phase(&self, phase: Phase) {
        let code = match phase {
            Phase::Idle => 0,
            Phase::Connecting => 1,
            Phase::Ready => 2,
            Phase::Backoff => 3,
            Phase::CircuitOpen => 4,
            Phase::Retired => 5,
        };
        self.phase.store(code, Ordering::Release);
        self.signal_change();
    }

    /// Publishes the epoch slices are prepared for: only after the poller was commanded
    /// to expect it.
    pub(crate) fn set_epoch(&self, epoch: Epoch) {
        self.epoch.store(epoch.get(), Ordering::Release);
        self.signal_change();
    }

    pub(crate) fn set_descriptor(&self, descriptor: Arc<SegmentDescriptor>) {
        *self
            .descriptor
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(descriptor);
        // Release, after the write: a reader that sees the new version finds the new
        // descriptor behind the lock.
        self.descriptor_version.fetch_add(1, Ordering::Release);
    }

    /// Changes each time the descriptor does: a reader that saw a version and kept the
    /// descriptor it then read may keep using it while the version stays.
    pub fn descriptor_version(&self) -> u64 {
        self.descriptor_version.load(Ordering::Acquire)
    }
}

impl ControlStats {
    /// Bytes of control state per known peer (all of it when none is known).
    pub fn control_bytes_per_peer(&self) -> u64 {
        self.control_state_bytes / self.known_peers.max(1)
    }
}

/// What the control plane has done, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlStats {
    /// Queue pairs this side created as dialer.
    pub active_qps: u64,
    /// Active queue pairs created after an endpoint's first (reconnects).
    pub reconnects: u64,
    /// ConnectQp requests answered by creating a passive queue pair.
    pub passive_qps: u64,
    /// Of the active and passive queue pairs, those on the TCP fabric.
    pub tcp_qps: u64,
    /// ConnectQp requests answered idempotently (same peer, same queue pair).
    pub idempotent_replies: u64,
    /// Passive queue pairs replaced or dropped, and endpoints retired: teardowns.
    pub teardowns: u64,
    /// Passive queue pairs taken out of service because their initiator retired them
    /// (RetireQp) or the application revoked their peer.
    pub passive_retired: u64,
    /// Peers seen coming back as a new incarnation.
    pub peer_restarts: u64,
    /// Circuit openings.
    pub circuit_openings: u64,
    /// ConnectQp requests refused.
    pub refused: u64,
    /// Warnings emitted, by [`WarningKind::index`] (before any rate limit of the log
    /// subscriber).
    pub warnings: [u64; WarningKind::ALL.len()],
    /// Notifications sent (queued on the control connection, or posted as an immediate).
    pub notifications_sent: u64,
    /// Notifications not sent: the batch they rode on failed, the connection closed before
    /// they went out, or `Policy::max_queued_output` of notifications already waited for
    /// the peer.
    pub notifications_dropped: u64,
    /// Notifications received.
    pub notifications_received: u64,
    /// Notifications refused: meant for another incarnation (one that had this address).
    pub notifications_refused: u64,
    /// Notifications received but discarded, oldest first, because the application did not
    /// drain them before [`NOTIFICATION_QUEUE`] entries or [`NOTIFICATION_BYTES`] piled up.
    pub notifications_discarded: u64,
    /// ConnectQp replies that matched no handshake waiting on that connection (an old
    /// attempt, a retired endpoint, another connection): ignored.
    pub stray_replies: u64,
    /// Connections closed for breaking a bound (output not read, a frame never finished)
    /// or the protocol (a message before Hello, a second identity).
    pub connections_closed: u64,
    /// Control connections closed because their peer did not prove the cluster secret
    /// (no proof, a wrong one, or a message before it).
    pub auth_failures: u64,
    /// Times the listener stopped accepting at a cap (connections, handshakes) or because
    /// the process ran out of file descriptors.
    pub accept_pauses: u64,
    /// Peers declared unreachable: silent on their control connection for the liveness
    /// timeout.
    pub unreachable_peers: u64,
    /// How long the last of them had been silent when declared unreachable, in ms (the
    /// detection time, measured from the last thing it said).
    pub last_detection_ms: u64,
    /// The longest such detection time, in ms.
    pub max_detection_ms: u64,
    /// Every detection time.
    pub detection_times: TimeHistogram,
    /// Idle endpoints parked to stay within [`Policy::max_endpoints_per_rail`] (their
    /// queue pairs freed).
    ///
    /// [`Policy::max_endpoints_per_rail`]: crate::Policy::max_endpoints_per_rail
    pub evictions: u64,
    /// Parks a poller refused: the endpoint had work queued or in flight.
    pub eviction_refusals: u64,
    /// Endpoints that had to wait for room on their rail (every other one was busy).
    pub endpoint_waits: u64,
    /// Parked endpoints connected again because traffic wanted them.
    pub wakes: u64,
    /// Handshakes that failed: refused, timed out, or their queue pair not adopted.
    pub handshake_failures: u64,
    /// Handshakes that waited their turn: at this side's cap on handshakes out, or (as a
    /// target) beyond its cap on those in progress, their initiator told to wait.
    pub handshakes_queued: u64,
    /// Handshakes waiting for their reply now (a gauge).
    pub handshakes_in_flight: u64,
    /// About how many bytes of memory the control plane's peer table holds (a gauge,
    /// refreshed every second).
    pub control_state_bytes: u64,
    /// Peer incarnations the control plane knows now (a gauge).
    pub known_peers: u64,
    /// Queue-pair handshakes that succeeded: from ConnectQp sent to its reply applied.
    pub handshake_times: TimeHistogram,
}

impl ControlStats {
    /// Warnings emitted, of every kind.
    pub fn warnings_total(&self) -> u64 {
        self.warnings.iter().sum()
    }
}

/// Upper bounds, in microseconds, of the buckets of a [`TimeHistogram`].
pub const TIME_BUCKET_BOUNDS_US: [u64; 14] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 5_000_000,
];

/// Durations counted into buckets: `buckets[i]` counts those above bound `i - 1` and at or
/// under [`TIME_BUCKET_BOUNDS_US`]`[i]` (not cumulative); those above the last bound are
/// `count` minus the buckets' sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeHistogram {
    /// Durations per bucket.
    pub buckets: [u64; TIME_BUCKET_BOUNDS_US.len()],
    /// Durations recorded.
    pub count: u64,
    /// Their sum, in microseconds.
    pub sum_us: u64,
}

impl TimeHistogram {
    /// The bucket bound at or under which at least `quantile` (0 to 1) of the durations
    /// fall: an upper bound of that quantile, in microseconds. `None` with nothing
    /// recorded, or when the quantile lies above the last bound.
    pub fn quantile_bound_us(&self, quantile: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let wanted = (quantile.clamp(0.0, 1.0) * self.count as f64).ceil() as u64;
        let mut seen = 0;
        for (bucket, bound) in self.buckets.iter().zip(TIME_BUCKET_BOUNDS_US) {
            seen += bucket;
            if seen >= wanted.max(1) {
                return Some(bound);
            }
        }
        None
    }
}

/// The shared, atomically updated form of a [`TimeHistogram`].
#[derive(Debug, Default)]
pub(crate) struct AtomicTimeHistogram {
    /// One per bound, then one for durations above the last: the count is their sum, so a
    /// snapshot taken during a `record` never has more in its buckets than in its count.
    buckets: [AtomicU64; TIME_BUCKET_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

impl AtomicTimeHistogram {
    pub(crate) fn record(&self, duration: Duration) {
        let us = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        let bucket = TIME_BUCKET_BOUNDS_US
            .iter()
            .position(|&bound| us <= bound)
            .unwrap_or(TIME_BUCKET_BOUNDS_US.len());
        bump(&self.buckets[bucket]);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    fn snapshot(&self) -> TimeHistogram {
        let counts: [u64; TIME_BUCKET_BOUNDS_US.len() + 1] =
            std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed));
        TimeHistogram {
            buckets: std::array::from_fn(|i| counts[i]),
            count: counts.iter().sum(),
            sum_us: self.sum_us.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) active_qps: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) passive_qps: AtomicU64,
    pub(crate) tcp_qps: AtomicU64,
    pub(crate) idempotent_replies: AtomicU64,
    pub(crate) teardowns: AtomicU64,
    pub(crate) passive_retired: AtomicU64,
    pub(crate) peer_restarts: AtomicU64,
    pub(crate) circuit_openings: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) warnings: [AtomicU64; WarningKind::ALL.len()],
    pub(crate) notifications_sent: AtomicU64,
    pub(crate) notifications_dropped: AtomicU64,
    pub(crate) notifications_received: AtomicU64,
    pub(crate) notifications_refused: AtomicU64,
    pub(crate) notifications_discarded: AtomicU64,
    pub(crate) stray_replies: AtomicU64,
    pub(crate) connections_closed: AtomicU64,
    pub(crate) auth_failures: AtomicU64,
    pub(crate) accept_pauses: AtomicU64,
    pub(crate) unreachable_peers: AtomicU64,
    pub(crate) last_detection_ms: AtomicU64,
    pub(crate) max_detection_ms: AtomicU64,
    pub(crate) detection_times: AtomicTimeHistogram,
    pub(crate) handshake_times: AtomicTimeHistogram,
    pub(crate) evictions: AtomicU64,
    pub(crate) eviction_refusals: AtomicU64,
    pub(crate) endpoint_waits: AtomicU64,
    pub(crate) wakes: AtomicU64,
    pub(crate) handshake_failures: AtomicU64,
    pub(crate) handshakes_queued: AtomicU64,
    pub(crate) handshakes_in_flight: AtomicU64,
    pub(crate) control_state_bytes: AtomicU64,
    pub(crate) known_peers: AtomicU64,
}

pub(crate) fn bump_by(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Per rail: the endpoints by id, read by the re-prepare hook.
#[derive(Debug, Default)]
struct RailShared {
    endpoints: RwLock<Vec<Option<Arc<EndpointView>>>>,
    /// Bumped after each change of `endpoints`: the re-prepare hook keeps its copy while it
    /// is equal.
    version: AtomicU64,
}

/// A re-prepare hook's copy of its rail's endpoints and their descriptors.
#[derive(Default)]
struct HookCache {
    /// The rail's `version` the copy was taken at (`None`: never).
    version: Option<u64>,
    endpoints: Vec<Option<Arc<EndpointView>>>,
    /// Per endpoint id: (its descriptor version, that descriptor).
    descriptors: Vec<Option<(u64, Arc<SegmentDescriptor>)>>,
}

impl HookCache {
    /// Endpoint `id` of `rail`, from the copy (refreshed first if the table changed).
    fn view(
        &mut self,
        shared: &ControlShared,
        rail: u16,
        id: EndpointId,
    ) -> Option<Arc<EndpointView>> {
        let table = shared.rails.get(usize::from(rail))?;
        let version = table.version.load(Ordering::Acquire);
        if self.version != Some(version) {
            self.endpoints = table
                .endpoints
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            self.descriptors.clear();
            self.version = Some(version);
        }
        self.endpoints.get(id.0 as usize)?.clone()
    }

    /// `view`'s descriptor, from the copy while its version stands.
    fn descriptor(&mut self, view: &EndpointView) -> Option<Arc<SegmentDescriptor>> {
        let index = view.id.0 as usize;
        let version = view.descriptor_version();
        if let Some(Some((kept, descriptor))) = self.descriptors.get(index) {
            if *kept == version {
                return Some(descriptor.clone());
            }
        }
        let descriptor = view.descriptor()?;
        if self.descriptors.len() <= index {
            self.descriptors.resize(index + 1, None);
        }
        self.descriptors[index] = Some((version, descriptor.clone()));
        Some(descriptor)
    }
}

/// What the control thread shares with pollers' re-prepare hooks and the application.
/// Create it first, give each poller its hook, then start the [`ControlPlane`](crate::ControlPlane) with it.
#[derive(Debug)]
pub struct ControlShared {
    rails: Vec<RailShared>,
    pub(crate) counters: Counters,
    regions: RwLock<(u64, Vec<RegionDescriptor>)>,
    notifications: Mutex<Received>,
    /// Signalled when notifications arrive.
    notified: Condvar,
}

/// Notifications waiting for the application, and the bytes they hold.
#[derive(Debug, Default)]
struct Received {
    queue: VecDeque<Notification>,
    bytes: usize,
}

impl Notification {
    /// Bytes it holds.
    fn size(&self) -> usize {
        let body = match &self.body {
            NotificationBody::Bytes(bytes) => bytes.len(),
            NotificationBody::Immediate(_) => 4,
        };
        self.from.len() + body
    }
}

impl ControlShared {
    /// Shared state for `rails` rails.
    pub fn new(rails: usize) -> Arc<Self> {
        Arc::new(Self {
            rails: (0..rails).map(|_| RailShared::default()).collect(),
            counters: Counters::default(),
            regions: RwLock::new((0, Vec::new())),
            notifications: Mutex::new(Received::default()),
            notified: Condvar::new(),
        })
    }

    /// The re-prepare hook for rail `rail`'s poller: rewrites a stale slice's rkey from the
    /// peer's newest descriptor (unless it is zero-length) and stamps the current epoch;
    /// refuses slices meant for a previous occupant of the endpoint id (`EndpointRetired`),
    /// prepared before the peer revoked this side (`Revoked`), or whose remote region is
    /// gone or registered anew since they were prepared (`RegionWithdrawn`): a slice may
    /// move to a new queue pair and epoch, never to other memory. It keeps its own copy of the rail's endpoints and their
    /// descriptors, refreshed when their versions change: no lock while they do not.
    pub fn reprepare_hook(self: &Arc<Self>, rail: u16) -> impl Reprepare + 'static {
        let shared = self.clone();
        let mut cache = HookCache::default();
        move |slice: &mut Slice, current: Epoch, _cause: RepairCause| {
            let view = cache
                .view(&shared, rail, slice.endpoint)
                .ok_or(FailReason::EndpointRetired)?;
            if slice.epoch.is_older_than(view.first_epoch) {
                return Err(FailReason::EndpointRetired);
            }
            if view.is_revoked(slice.epoch) {
                return Err(FailReason::Revoked);
            }
            if slice.len == 0 {
                // Names no memory (a bare immediate): only the epoch changes.
                slice.epoch = current;
                return Ok(());
            }
            let descriptor = cache.descriptor(&view).ok_or(FailReason::RemoteAccess)?;
            let region = descriptor
                .region_for(slice.remote_addr, u64::from(slice.len))
                .ok_or(FailReason::RegionWithdrawn)?;
            if region.generation as u32 != slice.generation {
                // Registered anew since: other memory now, whatever its address.
                return Err(FailReason::RegionWithdrawn);
            }
            slice.rkey = *region
                .rkeys
                .get(usize::from(view.key.remote_rail))
                .ok_or(FailReason::RemoteAccess)?;
            slice.epoch = current;
            Ok(())
        }
    }

    /// The endpoint `id` of rail `rail`, while it exists: how a [`RequestFailure`]'s
    /// endpoint is named as a peer.
    ///
    /// [`RequestFailure`]: railyard_dataplane::RequestFailure
    pub fn view(&self, rail: u16, id: EndpointId) -> Option<Arc<EndpointView>> {
        self.rails
            .get(usize::from(rail))?
            .endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id.0 as usize)?
            .clone()
    }

    /// Every endpoint that exists now, with its rail (for reports: takes each rail's lock).
    pub fn endpoints(&self) -> Vec<(u16, Arc<EndpointView>)> {
        let mut endpoints = Vec::new();
        for (rail, shared) in (0u16..).zip(&self.rails) {
            let views = shared
                .endpoints
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            endpoints.extend(views.iter().flatten().map(|view| (rail, view.clone())));
        }
        endpoints
    }

    /// Publishes this process's regions (a new generation of its descriptor).
    pub fn set_regions(&self, regions: Vec<RegionDescriptor>) {
        let mut guard = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        guard.0 += 1;
        guard.1 = regions;
    }

    /// Takes the notifications peers sent, oldest first.
    pub fn drain_notifications(&self) -> Vec<Notification> {
        let mut received = self
            .notifications
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        received.bytes = 0;
        received.queue.drain(..).collect()
    }

    /// Takes the notifications peers sent, oldest first, waiting until at least one is
    /// there or `deadline` passes (then the result is empty).
    pub fn wait_notifications(&self, deadline: Instant) -> Vec<Notification> {
        let mut received = self
            .notifications
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while received.queue.is_empty() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            received = self
                .notified
                .wait_timeout(received, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        received.bytes = 0;
        received.queue.drain(..).collect()
    }

    /// This process's published regions.
    pub(crate) fn regions(&self) -> Vec<RegionDescriptor> {
        self.regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .clone()
    }

    /// Queues notifications for the application, counting each as received; beyond
    /// [`NOTIFICATION_QUEUE`] entries or [`NOTIFICATION_BYTES`] the oldest are discarded
    /// (and counted).
    pub(crate) fn deliver(&self, notifications: impl IntoIterator<Item = Notification>) {
        let mut received = self
            .notifications
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for notification in notifications {
            bump(&self.counters.notifications_received);
            received.bytes += notification.size();
            received.queue.push_back(notification);
            while received.queue.len() > NOTIFICATION_QUEUE || received.bytes > NOTIFICATION_BYTES {
                let Some(oldest) = received.queue.pop_front() else {
                    break;
                };
                received.bytes -= oldest.size();
                bump(&self.counters.notifications_discarded);
            }
        }
        if !received.queue.is_empty() {
            self.notified.notify_all();
        }
    }

    /// Counts a peer declared unreachable after `silent`.
    pub(crate) fn record_detection(&self, silent: Duration) {
        let ms = u64::try_from(silent.as_millis()).unwrap_or(u64::MAX);
        bump(&self.counters.unreachable_peers);
        self.counters.last_detection_ms.store(ms, Ordering::Relaxed);
        self.counters
            .max_detection_ms
            .fetch_max(ms, Ordering::Relaxed);
        self.counters.detection_times.record(silent);
    }

    /// Counts a warning of `kind` (see [`crate::warn`]).
    pub(crate) fn count_warning(&self, kind: WarningKind) {
        bump(&self.counters.warnings[kind.index()]);
    }

    /// Publishes `view` as endpoint `view.id` of `rail`, or clears the slot (`None`).
    pub(crate) fn publish(&self, rail: u16, id: EndpointId, view: Option<Arc<EndpointView>>) {
        let Some(rail) = self.rails.get(usize::from(rail)) else {
            return;
        };
        let mut endpoints = rail
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let index = id.0 as usize;
        if endpoints.len() <= index {
            endpoints.resize(index + 1, None);
        }
        endpoints[index] = view;
        // Release, under the lock: a hook that sees the new version reads the new table.
        rail.version.fetch_add(1, Ordering::Release);
    }

    /// How many endpoint slots `rail` has (the next fresh id).
    pub(crate) fn endpoint_slots(&self, rail: u16) -> usize {
        self.rails.get(usize::from(rail)).map_or(0, |rail| {
            rail.endpoints
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .len()
        })
    }

    /// What the control plane has done so far.
    pub fn stats(&self) -> ControlStats {
        let c = &self.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ControlStats {
            active_qps: get(&c.active_qps),
            reconnects: get(&c.reconnects),
            passive_qps: get(&c.passive_qps),
            tcp_qps: get(&c.tcp_qps),
            idempotent_replies: get(&c.idempotent_replies),
            teardowns: get(&c.teardowns),
            passive_retired: get(&c.passive_retired),
            peer_restarts: get(&c.peer_restarts),
            circuit_openings: get(&c.circuit_openings),
            refused: get(&c.refused),
            warnings: std::array::from_fn(|i| get(&c.warnings[i])),
            notifications_sent: get(&c.notifications_sent),
            notifications_dropped: get(&c.notifications_dropped),
            notifications_received: get(&c.notifications_received),
            notifications_refused: get(&c.notifications_refused),
            notifications_discarded: get(&c.notifications_discarded),
            stray_replies: get(&c.stray_replies),
            connections_closed: get(&c.connections_closed),
            auth_failures: get(&c.auth_failures),
            accept_pauses: get(&c.accept_pauses),
            unreachable_peers: get(&c.unreachable_peers),
            last_detection_ms: get(&c.last_detection_ms),
            max_detection_ms: get(&c.max_detection_ms),
            detection_times: c.detection_times.snapshot(),
            handshake_times: c.handshake_times.snapshot(),
            evictions: get(&c.evictions),
            eviction_refusals: get(&c.eviction_refusals),
            endpoint_waits: get(&c.endpoint_waits),
            wakes: get(&c.wakes),
            handshake_failures: get(&c.handshake_failures),
            handshakes_queued: get(&c.handshakes_queued),
            handshakes_in_flight: get(&c.handshakes_in_flight),
            control_state_bytes: get(&c.control_state_bytes),
            known_peers: get(&c.known_peers),
        }
    }
}

/// A notification a peer sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name.
    pub from: String,
    /// The sender's incarnation.
    pub incarnation: Incarnation,
    /// What it said.
    pub body: NotificationBody,
}

/// What a notification carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotificationBody {
    /// Bytes sent on the control connection ([`ControlPlane::notify`](crate::ControlPlane::notify)).
    Bytes(Vec<u8>),
    /// A 32-bit value that arrived as a WRITE_WITH_IMM's immediate on a rail
    /// ([`ControlPlane::signal`](crate::ControlPlane::signal)).
    Immediate(u32),
}

/// Notifications kept for the application before the oldest are discarded.
pub const NOTIFICATION_QUEUE: usize = 64 * 1024;
/// Bytes of notifications kept for the application before the oldest are discarded.
pub const NOTIFICATION_BYTES: usize = 64 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_land_in_the_first_bucket_whose_bound_holds_them() {
        let histogram = AtomicTimeHistogram::default();
        for us in [50, 100, 101, 5_000_000, 5_000_001, u64::MAX / 2] {
            histogram.record(Duration::from_micros(us));
        }
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.buckets[0], 2, "50 and 100 µs: at or under 100");
        assert_eq!(snapshot.buckets[1], 1, "101 µs: at or under 250");
        assert_eq!(snapshot.buckets[TIME_BUCKET_BOUNDS_US.len() - 1], 1, "5 s");
        assert_eq!(snapshot.buckets.iter().sum::<u64>(), 4);
        assert_eq!(snapshot.count, 6, "two above the last bound");
        assert_eq!(
            snapshot.sum_us,
            50 + 100 + 101 + 5_000_000 + 5_000_001 + u64::MAX / 2
        );
    }

    fn bytes(n: usize) -> Notification {
        Notification {
            from: "peer".into(),
            incarnation: Incarnation(1),
            body: NotificationBody::Bytes(vec![0; n]),
        }
    }

    fn descriptor(rkey: u32) -> Arc<SegmentDescriptor> {
        Arc::new(SegmentDescriptor {
            name: "peer".into(),
            incarnation: Incarnation(7),
            handshake_addr: "127.0.0.1:1".into(),
            rails: Vec::new(),
            regions: vec![crate::RegionDescriptor {
                base: 0x1000,
                len: 0x1000,
                rkeys: vec![rkey],
                generation: u64::from(rkey),
                access: railyard_dataplane::fabric::Access::ALL,
            }],
        })
    }

    /// Caught: a re-prepare hook that keeps its copies without looking at the versions
    /// re-prepares with a descriptor (or an endpoint) that was replaced.
    #[test]
    fn the_hooks_copies_follow_the_versions() {
        let shared = ControlShared::new(1);
        let key = crate::EndpointKey {
            peer: Incarnation(7),
            local_rail: 0,
            remote_rail: 0,
        };
        let id = EndpointId(3);
        let view = Arc::new(EndpointView::new(
            id,
            key,
            "peer".into(),
            Epoch::FIRST,
            Some(descriptor(11)),
        ));
        shared.publish(0, id, Some(view.clone()));
        let mut cache = HookCache::default();
        let rkey = |cache: &mut HookCache| {
            let view = cache.view(&shared, 0, id).expect("published");
            cache.descriptor(&view).expect("has one").regions[0].rkeys[0]
        };
        assert_eq!(rkey(&mut cache), 11);
        view.set_descriptor(descriptor(12));
        assert_eq!(rkey(&mut cache), 12, "a new descriptor is seen");
        shared.publish(0, id, None);
        assert!(
            cache.view(&shared, 0, id).is_none(),
            "a cleared slot is seen"
        );
        let successor = Arc::new(EndpointView::new(
            id,
            key,
            "peer".into(),
            Epoch::FIRST.next(),
            Some(descriptor(13)),
        ));
        shared.publish(0, id, Some(successor));
        assert_eq!(
            rkey(&mut cache),
            13,
            "a new occupant of the id, with its own"
        );
    }

    #[test]
    fn the_notification_queue_is_bounded_in_bytes_and_entries() {
        let shared = ControlShared::new(0);
        let large = NOTIFICATION_BYTES / 4 + 1;
        shared.deliver((0..4).map(|_| bytes(large)));
        let stats = shared.stats();
        assert_eq!(stats.notifications_received, 4);
        assert_eq!(stats.notifications_discarded, 1, "the oldest went");
        assert_eq!(shared.drain_notifications().len(), 3);
        shared.deliver((0..NOTIFICATION_QUEUE + 10).map(|_| bytes(1)));
        assert_eq!(shared.stats().notifications_discarded, 11);
        assert_eq!(shared.drain_notifications().len(), NOTIFICATION_QUEUE);
        shared.deliver([bytes(NOTIFICATION_BYTES - "peer".len())]);
        assert_eq!(
            shared.drain_notifications().len(),
            1,
            "draining emptied the byte count"
        );
    }
}
