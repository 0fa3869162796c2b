//! The poller: one thread per rail, the only code that touches the rail's fabric queues and
//! endpoints.
//!
//! Its loop: drain the submission rings → apply commands (add an endpoint, bump its epoch,
//! retire it, open or close its circuit, shut down) → post what waited for credits and has
//! them now, apply the epoch rule to new slices and post what passes and has credits, one
//! doorbell per queue pair per round → poll completions and resolve slices → sweep
//! deadlines → idle. Submissions are drained before commands so that a slice prepared
//! for an epoch the control plane has announced always finds that epoch's command applied:
//! the control plane sends the command first and publishes the epoch to submitters after.
//!
//! The decisions the loop carries out live in small modules with their own tests: `rule`
//! (pure functions: the epoch rule, where a slice goes on its endpoint, the backlog's bound,
//! the retry rule), `credits` (an endpoint's credits on its queue pair), `deadline` (sweeps
//! and overdue work) and `inflight` (the table of posted work requests by slot and
//! generation).
//!
//! # Credits
//! A queue pair carries at most its send queue's depth of posted work requests and the rail
//! at most what its completion queue holds ([`FabricLimits`], flushes a retire will produce
//! included: every request completes exactly once). A slice that passes the epoch rule
//! without a credit waits, in order, in its endpoint's queue for credits until completions
//! return some (its deadline still applies). A post the fabric cuts short with
//! `SendQueueFull` is backpressure, not failure: the refused rest goes back to the front of
//! that queue. Only errors that cannot pass fail a slice `PostFailed`. Each round's posts
//! are gathered per queue pair and posted with one call (one doorbell) each.
//!
//! # The epoch rule
//! A slice whose epoch is older than its endpoint's current epoch is never posted: it goes
//! to the [`Reprepare`] hook, which rewrites it for the current epoch or names a reason to
//! fail it. A slice newer than its endpoint (the poller has not applied the reconnect yet)
//! and a slice for an endpoint whose queue pair failed wait in the endpoint's bounded
//! backlog until the epoch arrives or their deadline passes.
//!
//! # Failures
//! Any error completion leaves the queue pair in ERR (as verbs does): the poller retires it,
//! which flushes everything else outstanding on it, marks the endpoint down and reports
//! [`Event::QpFailed`] so the owner of endpoints can reconnect at a new epoch. Flushed and
//! transport-failed slices are retried (within [`PollerConfig::retry_budget`]) at the new
//! epoch — those flushed behind another slice's work-request error without being charged
//! for it; a slice whose own work request was wrong (length, protection, access) is
//! re-prepared once and fails the second time, so it can never take a fresh queue pair down
//! twice. A WRITE_WITH_IMM that was flushed or cut off is never retried: its immediate may
//! have been delivered, and an immediate is delivered at most once.
//!
//! # Nothing moves after it is reported
//! A slice resolves only when the fabric no longer holds its buffers. A slice whose deadline
//! passes while it is still queued here resolves with `Timeout` at once; one whose deadline
//! passes while it is posted is marked, its queue pair is taken out of service (retired: ERR,
//! flush, [`Event::QpFailed`] with RETRY_EXC_ERR, a new epoch for the endpoint's other work),
//! and it resolves with `Timeout` when the flush hands it back. Shutdown follows the same
//! rule. A fabric that breaks its promise to flush within [`PollerConfig::flush_grace`] has
//! the queue pair torn down ([`Fabric::abandon`]: destroyed, its connection closed) before
//! the work on it is resolved as flushed, so even then nothing moves after a report; each
//! such request is counted as `unflushed`. Only a fabric that cannot tear a queue pair down
//! (libfabric, whose operations only closing the shared endpoint would recall) has its
//! overdue work resolved while the provider still holds it.
//!
//! # Stopping
//! However the poller thread ends — a shutdown command or a panic — it marks itself stopped,
//! resolves what it held, and leaves its rings where a submitter that pushed too late finds
//! and resolves them ([`PollerShared::wake`]). Events to the owner of endpoints are never
//! dropped: when the event ring is full they wait, coalesced per endpoint (the latest wins).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::batch::FailReason;
use crate::fabric::{
    AsyncEvent, Fabric, FabricError, FabricLimits, Opcode, QpNum, WcStatus, WorkCompletion,
    WorkRequest, WrId,
};
use crate::quiesce::Rounds;
use crate::ring::{self, Consumer, Producer};
use crate::sabotage::Protection;
use crate::slice::{FLAG_ADMITTED, FLAG_TIMED_OUT, FLAG_WR_ERROR_SEEN, Slice};
use crate::{EndpointId, Epoch};

mod credits;
mod deadline;
mod inflight;
mod rule;

use credits::Credits;
use deadline::{Overdue, SweepClock};
use inflight::Inflight;
use rule::{BacklogRoom, FailedRequest, LinkState, Placement, Retry, Route, epoch_rule};

/// What a poller does when a round found no work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleStrategy {
    /// Spin forever: lowest latency, burns the core. For pinned production pollers.
    BusySpin,
    /// Spin `spins` rounds, then yield the core each round.
    SpinThenYield {
        /// Idle rounds spent spinning before yielding.
        spins: u32,
    },
    /// Spin `spins` rounds, then park for at most `park` (a submitter or command wakes it
    /// earlier). Parks only with nothing in flight and no peer to serve; otherwise it
    /// yields.
    SpinThenPark {
        /// Idle rounds spent spinning before parking.
        spins: u32,
        /// Longest park.
        park: Duration,
    },
}

impl IdleStrategy {
    /// An idle strategy that cannot starve a small machine: what tests use.
    pub const fn gentle() -> Self {
        Self::SpinThenPark {
            spins: 64,
            park: Duration::from_millis(2),
        }
    }
}

/// How to run a poller.
#[derive(Clone, Debug)]
pub struct PollerConfig {
    /// Thread name (the rail's name).
    pub name: String,
    /// PU (OS CPU index) to pin the thread to; `None` leaves it unpinned.
    pub pin_pu: Option<usize>,
    /// What to do when idle.
    pub idle: IdleStrategy,
    /// Most slices taken from one submission ring per round, and most completions polled.
    pub max_batch: usize,
    /// Retries of a flushed or transport-failed slice before it fails.
    pub retry_budget: u8,
    /// Most slices arriving for an endpoint while it is down (reconnecting) that it holds
    /// until its next queue pair; more fail with `BacklogFull`. Slices it had admitted
    /// before (waiting for credits when its queue pair went) do not count. 64 Ki by default:
    /// a burst of 16 GiB in 256 KiB slices rides out a reconnect, for a few MiB of records.
    pub backlog_limit: usize,
    /// Slots of the command ring.
    pub command_capacity: usize,
    /// Slots of the event ring (more events wait, coalesced per endpoint).
    pub event_capacity: usize,
    /// How long the fabric has to hand back the work of a queue pair taken out of service (a
    /// deadline passed while it was posted, or shutdown) before it is resolved without the
    /// flush. A fabric that keeps its promise flushes well within it.
    pub flush_grace: Duration,
}

impl PollerConfig {
    /// Defaults for a poller named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pin_pu: None,
            idle: IdleStrategy::SpinThenYield { spins: 1024 },
            max_batch: 64,
            retry_budget: 3,
            backlog_limit: 64 * 1024,
            command_capacity: 256,
            event_capacity: 1024,
            flush_grace: Duration::from_secs(1),
        }
    }
}

/// A command to a poller. Commands are applied between posts, in order.
#[derive(Debug)]
#[non_exhaustive]
pub enum Command {
    /// Connect a queue pair to `endpoint` at `epoch`. For an endpoint the poller already has,
    /// this is [`Command::BumpEpoch`].
    AddEndpoint {
        /// The endpoint.
        endpoint: EndpointId,
        /// Its epoch.
        epoch: Epoch,
    },
    /// Replace the endpoint's queue pair by a new one at `epoch` (retiring the old one,
    /// whose outstanding work is flushed and retried at `epoch`). Ignored unless `epoch` is
    /// newer than the endpoint's: a repeated command changes nothing.
    BumpEpoch {
        /// The endpoint.
        endpoint: EndpointId,
        /// The new epoch.
        epoch: Epoch,
    },
    /// Retire the endpoint: flush its queue pair, fail its backlog and everything later sent
    /// to it with `reason` (usually `EndpointRetired`; `PeerRestarted` when the peer came
    /// back as a new incarnation), and report [`Event::EndpointDrained`] once nothing of it
    /// is in flight.
    RetireEndpoint {
        /// The endpoint.
        endpoint: EndpointId,
        /// What its slices fail with.
        reason: FailReason,
    },
    /// Open or close the endpoint's circuit. While it is open its backlog and every slice
    /// sent to it fail at once with `PeerUnavailable`, so a dead peer never holds work
    /// until deadlines.
    SetCircuit {
        /// The endpoint.
        endpoint: EndpointId,
        /// Open (fail fast) or closed (carry traffic).
        open: bool,
    },
    /// The peer stopped answering: open the circuit (as `SetCircuit`) and take the current
    /// queue pair out of service, so that what is posted on it is flushed and fails with
    /// `PeerUnavailable` instead of waiting for its deadline.
    Unreachable {
        /// The endpoint.
        endpoint: EndpointId,
    },
    /// Resolve everything (in-flight work is flushed; queued work fails with `Shutdown`) and
    /// stop the thread.
    Shutdown,
}

/// What a poller reports to the owner of endpoints.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A queue pair went to ERR; the endpoint is down until a newer epoch arrives.
    QpFailed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the failed queue pair.
        epoch: Epoch,
        /// The completion status that failed it (work-request errors are the slice's fault,
        /// transport errors the peer's).
        status: WcStatus,
    },
    /// The fabric reported the queue pair fatal (IBV_EVENT_QP_FATAL): it is in ERR, its work
    /// is flushed and retried at a newer epoch; the endpoint is down until then. A transport
    /// failure, charged to the peer.
    QpFatal {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the failed queue pair.
        epoch: Epoch,
    },
    /// Connecting a queue pair failed; the endpoint is down.
    ConnectFailed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
        /// The fabric's reason.
        reason: String,
    },
    /// The first successful completion on the endpoint's queue pair at `epoch`: the peer
    /// answers on it (what closes a half-open circuit and ends a flap window).
    Confirmed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the queue pair.
        epoch: Epoch,
    },
    /// A retired endpoint has nothing left in flight.
    EndpointDrained {
        /// The endpoint.
        endpoint: EndpointId,
    },
}

impl Event {
    /// The endpoint it is about.
    pub fn endpoint(&self) -> EndpointId {
        match *self {
            Self::QpFailed { endpoint, .. }
            | Self::QpFatal { endpoint, .. }
            | Self::ConnectFailed { endpoint, .. }
            | Self::Confirmed { endpoint, .. }
            | Self::EndpointDrained { endpoint } => endpoint,
        }
    }
}

/// Why a stale slice is being re-prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairCause {
    /// Its epoch is older than its endpoint's.
    StaleEpoch,
    /// Its own work request failed (length, protection, access) on the previous queue pair;
    /// the descriptor should be refreshed. This is its only second chance.
    AfterWorkRequestError,
}

/// Rewrites a stale slice for its endpoint's current epoch: supplied by the owner of
/// segment descriptors.
pub trait Reprepare: Send {
    /// Rewrites `slice` (remote address, keys, epoch) for `current`, or returns why it must
    /// fail. A slice still older than `current` afterwards fails with `StaleEpoch`.
    ///
    /// # Errors
    /// The reason the slice fails.
    fn reprepare(
        &mut self,
        slice: &mut Slice,
        current: Epoch,
        cause: RepairCause,
    ) -> Result<(), FailReason>;
}

impl<F> Reprepare for F
where
    F: FnMut(&mut Slice, Epoch, RepairCause) -> Result<(), FailReason> + Send,
{
    fn reprepare(
        &mut self,
        slice: &mut Slice,
        current: Epoch,
        cause: RepairCause,
    ) -> Result<(), FailReason> {
        self(slice, current, cause)
    }
}

/// A [`Reprepare`] that fails every stale slice with `StaleEpoch`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FailStale;

impl Reprepare for FailStale {
    fn reprepare(&mut self, _: &mut Slice, _: Epoch, _: RepairCause) -> Result<(), FailReason> {
        Err(FailReason::StaleEpoch)
    }
}

/// A counter with a single writer (the poller thread).
#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    fn add(&self, n: u64) {
        // Relaxed load + store: only the poller writes, readers want a recent value.
        self.0
            .store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }

    fn sub(&self, n: u64) {
        // As `add`: one writer.
        self.0.store(
            self.0.load(Ordering::Relaxed).saturating_sub(n),
            Ordering::Relaxed,
        );
    }

    fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
struct Counters {
    posted: Counter,
    completed: Counter,
    failed: [Counter; FailReason::COUNT],
    reprepared: Counter,
    stale_dropped: Counter,
    idle_rounds: Counter,
    busy_rounds: Counter,
    /// Work requests posted and not yet completed, as of the last busy round.
    in_flight: Counter,
    ignored_completions: Counter,
    events_coalesced: Counter,
    unflushed: Counter,
    doorbells: Counter,
    credit_waits: Counter,
    send_queue_full: Counter,
    /// Bytes of the slices taken from the rings and not yet resolved: the rail's load.
    load_bytes: Counter,
    rail_downs: Counter,
    rail_ups: Counter,
}

/// A poller's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Work requests posted.
    pub posted: u64,
    /// Slices completed successfully.
    pub completed: u64,
    /// Slices failed, by [`FailReason::index`].
    pub failed: [u64; FailReason::COUNT],
    /// Stale slices re-prepared for a newer epoch.
    pub reprepared: u64,
    /// Stale slices the re-prepare hook refused (failed, never posted).
    pub stale_dropped: u64,
    /// Rounds that found no work.
    pub idle_rounds: u64,
    /// Rounds that did some work: with [`Self::idle_rounds`], how busy the poller's core is.
    pub busy_rounds: u64,
    /// Work requests posted to the fabric and not yet completed.
    pub in_flight: u64,
    /// Completions for a slot that had moved on (ignored).
    pub ignored_completions: u64,
    /// Events replaced by a later event of the same endpoint while the event ring was full.
    pub events_coalesced: u64,
    /// Posted slices the fabric did not hand back within [`PollerConfig::flush_grace`] of
    /// being taken out of service, resolved once their queue pair was torn down (a fabric
    /// bug: zero).
    pub unflushed: u64,
    /// Post calls made (one per queue pair per round with work for it).
    pub doorbells: u64,
    /// Slices that waited for credits (a full send queue or completion queue) before they
    /// were posted.
    pub credit_waits: u64,
    /// Post calls the fabric cut short with `SendQueueFull` (their rest waited, then went).
    pub send_queue_full: u64,
    /// Bytes of the slices taken from the rings and not yet resolved (queued, waiting for
    /// credits or in flight): the rail's load, which submitters balance.
    pub load_bytes: u64,
    /// Times the fabric said the rail went down (port, completion queue, device).
    pub rail_downs: u64,
    /// Times it said the rail's port came back.
    pub rail_ups: u64,
}

impl CounterSnapshot {
    /// Slices failed with `reason`.
    pub fn failed(&self, reason: FailReason) -> u64 {
        self.failed[reason.index()]
    }

    /// Slices failed for any reason.
    pub fn failed_total(&self) -> u64 {
        self.failed.iter().sum()
    }
}

/// What submitters and the handle share with the poller thread.
#[derive(Debug, Default)]
pub(crate) struct PollerShared {
    counters: Counters,
    /// Set while the poller is (about to be) parked.
    parked: AtomicBool,
    thread: OnceLock<Thread>,
    /// Set once the poller stops reading its rings.
    stopped: AtomicBool,
    /// Set by [`PollerHandle::shutdown`]: stop, even if the command ring has no room.
    stop_requested: AtomicBool,
    /// The rings of a stopped poller, for late pushes to be resolved.
    orphans: Mutex<Orphans>,
    /// Rounds finished. See [`PollerHandle::quiesce`].
    rounds: Rounds,
    /// Waits for local keys to fall out of use. See [`PollerHandle::drain_local`].
    drains: Mutex<Vec<LocalDrain>>,
    /// How many `drains` there are: the poller looks at them only when there are some.
    drains_pending: AtomicU64,
}

/// One [`PollerHandle::drain_local`] call, answered by the poller.
#[derive(Debug)]
struct LocalDrain {
    lkeys: Vec<u32>,
    /// Set by the poller once no posted request goes through `lkeys`.
    drained: Arc<AtomicBool>,
}

/// What a stopped poller leaves behind: its command ring (which may still bring a new
/// submission ring) and its submission rings.
#[derive(Default)]
struct Orphans {
    control: Option<Consumer<Control>>,
    rings: Vec<Consumer<Slice>>,
}

impl Orphans {
    /// Resolves (`PollerGone`) every slice left in the rings.
    fn resolve_leftovers(&mut self) {
        if let Some(control) = &mut self.control {
            while let Some(control) = control.pop() {
                if let Control::AddSubmitter(ring) = control {
                    self.rings.push(ring);
                }
            }
        }
        for ring in &mut self.rings {
            while let Some(slice) = ring.pop() {
                slice.resolve(Err(FailReason::PollerGone));
            }
        }
    }
}

impl std::fmt::Debug for Orphans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orphans")
            .field("rings", &self.rings.len())
            .finish()
    }
}

impl PollerShared {
    /// Wakes the poller if it is parked. Call after publishing work: if the poller has
    /// stopped meanwhile, what was published is resolved here (`PollerGone`).
    pub(crate) fn wake(&self) {
        // SeqCst fence: pairs with the poller's fence between setting `parked` and
        // re-checking its rings (either it sees our work, or we see it parked), and with its
        // fence between setting `stopped` and its last look at the rings (either that look
        // sees our work, or we see it stopped).
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) {
            if let Some(thread) = self.thread.get() {
                thread.unpark();
            }
        }
        if self.stopped.load(Ordering::Relaxed) {
            // The poller hands its rings over under this lock after its last look, so either
            // they are here, or its last look comes after this and sees our work.
            lock(&self.orphans).resolve_leftovers();
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
}

/// What travels on the control ring.
enum Control {
    Command(Command),
    AddSubmitter(Consumer<Slice>),
}

/// Why a poller could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The OS refused to pin the poller thread.
    #[error(
        "cannot pin poller {name} to PU {pu}: not a CPU this process may run on, or the OS refused"
    )]
    Pin {
        /// The poller's name.
        name: String,
        /// The PU asked for.
        pu: usize,
    },
    /// The OS refused to create the thread.
    #[error("cannot start poller thread {name}")]
    Thread {
        /// The poller's name.
        name: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The poller is no longer running, or has taken no command for [`COMMAND_WAIT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the poller has stopped")]
pub struct PollerStopped;

/// How long a command waits for room in a full command ring. A running poller empties it
/// every round; one that has not for this long (the default batch deadline) is wedged, and
/// is treated as stopped.
pub const COMMAND_WAIT: Duration = Duration::from_secs(5);

/// Owner's handle to a running poller. `Send + Sync`. Dropping it shuts the poller down.
pub struct PollerHandle {
    name: String,
    shared: Arc<PollerShared>,
    control: Mutex<Producer<Control>>,
    events: Mutex<Option<Consumer<Event>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PollerHandle {
    /// Starts a poller thread driving `fabric`, pinned as `config` says.
    ///
    /// # Errors
    /// [`SpawnError::Pin`] when the OS refuses the pinning, [`SpawnError::Thread`] when it
    /// refuses the thread.
    pub fn spawn<F: Fabric + 'static>(
        config: PollerConfig,
        fabric: F,
        reprepare: impl Reprepare + 'static,
    ) -> Result<Self, SpawnError> {
        if let Some(pu) = config.pin_pu {
            // core_affinity panics on CPU numbers past CPU_SETSIZE: only pass allowed ones.
            let allowed = core_affinity::get_core_ids().unwrap_or_default();
            if !allowed.iter().any(|core| core.id == pu) {
                return Err(SpawnError::Pin {
                    name: config.name,
                    pu,
                });
            }
        }
        let shared = Arc::new(PollerShared::default());
        let (control_tx, control_rx) = ring::channel(config.command_capacity);
        let (events_tx, events_rx) = ring::channel(config.event_capacity);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let name = config.name.clone();
        let limits = fabric.limits();
        let poller = Poller {
            // A queue of no entries would hold every slice until its deadline.
            limits: FabricLimits {
                send_queue: limits.send_queue.max(1),
                completion_queue: limits.completion_queue.max(1),
            },
            fabric,
            reprepare: Box::new(reprepare),
            shared: shared.clone(),
            control: control_rx,
            events: events_tx,
            submissions: Vec::new(),
            endpoints: Vec::new(),
            ready: VecDeque::new(),
            inflight: Inflight::default(),
            posts: Vec::new(),
            spare_lists: Vec::new(),
            starved: Vec::new(),
            completions: Vec::new(),
            pending_events: BTreeMap::new(),
            overdue: Vec::new(),
            sweep: SweepClock::new(Instant::now()),
            stopping: false,
            config: config.clone(),
        };
        let thread = thread::Builder::new()
            .name(config.name.clone())
            .spawn(move || {
                if let Some(pu) = config.pin_pu {
                    let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: pu });
                    let _ = started_tx.send(pinned);
                    if !pinned {
                        return;
                    }
                } else {
                    let _ = started_tx.send(true);
                }
                poller.run();
            })
            .map_err(|source| SpawnError::Thread {
                name: name.clone(),
                source,
            })?;
        let _ = shared.thread.set(thread.thread().clone());
        if started_rx.recv() != Ok(true) {
            let _ = thread.join();
            return Err(SpawnError::Pin {
                name,
                pu: config.pin_pu.unwrap_or_default(),
            });
        }
        Ok(Self {
            name,
            shared,
            control: Mutex::new(control_tx),
            events: Mutex::new(Some(events_rx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Bytes of the slices it holds, taken from the rings and not yet resolved: what a
    /// submitter balances rails by. Cheap (one relaxed load).
    pub fn load_bytes(&self) -> u64 {
        self.shared.counters.load_bytes.get()
    }

    /// The poller's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn send_control(&self, mut control: Control) -> Result<(), PollerStopped> {
        let mut ring = lock(&self.control);
        let give_up = Instant::now() + COMMAND_WAIT;
        loop {
            if self.shared.is_stopped() {
                return Err(PollerStopped);
            }
            match ring.push(control) {
                Ok(()) => {
                    // Resolves what a poller that stopped meanwhile will never read.
                    self.shared.wake();
                    if self.shared.is_stopped() {
                        return Err(PollerStopped);
                    }
                    return Ok(());
                }
                Err(full) => {
                    // The poller drains commands every round; a full ring empties quickly.
                    if Instant::now() >= give_up {
                        return Err(PollerStopped);
                    }
                    control = full.into_inner();
                    self.shared.wake();
                    thread::yield_now();
                }
            }
        }
    }

    /// Sends a command; it is applied between posts, after earlier commands.
    ///
    /// # Errors
    /// [`PollerStopped`] when the poller no longer runs.
    pub fn send(&self, command: Command) -> Result<(), PollerStopped> {
        self.send_control(Control::Command(command))
    }

    /// Registers a new submission ring of `capacity` slots with the poller.
    pub(crate) fn register_submitter(
        &self,
        capacity: usize,
    ) -> Result<(Producer<Slice>, Arc<PollerShared>), PollerStopped> {
        let (producer, consumer) = ring::channel(capacity);
        self.send_control(Control::AddSubmitter(consumer))?;
        Ok((producer, self.shared.clone()))
    }

    /// The ring of [`Event`]s; `None` after the first call (it has one reader).
    pub fn take_events(&self) -> Option<Consumer<Event>> {
        lock(&self.events).take()
    }

    /// Waits until the poller has finished the round it is in, if any: once it returns true,
    /// every check the poller made before the call has been acted on, and every later check
    /// sees what the caller did before calling. What a region's deregistration waits for
    /// after withdrawing its keys, before the memory may be unmapped. Wakes a parked poller.
    /// True at once for a poller that has stopped; false if `deadline` passes first.
    pub fn quiesce(&self, deadline: Instant) -> bool {
        let snapshot = self.shared.rounds.snapshot();
        loop {
            if self.shared.rounds.passed(snapshot) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            if let Some(thread) = self.shared.thread.get() {
                thread.unpark();
            }
            thread::yield_now();
        }
    }

    /// Waits until no work request this poller posted through any of `lkeys` is still
    /// outstanding — completed, or flushed by its queue pair's retirement — so the fabric
    /// will not read or write that local memory for it any more. What a region's
    /// deregistration waits for after withdrawing its keys and [`Self::quiesce`] (which
    /// makes sure no post through them is under way): a provider that moves bytes into
    /// local memory itself (libfabric's software providers land a READ's response there
    /// whether or not its registration is still open) would otherwise write the region
    /// after it was handed back. A request resolved without its completion (its fabric
    /// missed the flush grace) counts as outstanding until the completion comes. True once
    /// the poller has finished for good (stopped, everything it held resolved); false if
    /// `deadline` passes first.
    pub fn drain_local(&self, lkeys: &[u32], deadline: Instant) -> bool {
        let drained = Arc::new(AtomicBool::new(false));
        lock(&self.shared.drains).push(LocalDrain {
            lkeys: lkeys.to_vec(),
            drained: drained.clone(),
        });
        // Release: the poller that sees the count sees the drain in the list (it locks it).
        self.shared.drains_pending.fetch_add(1, Ordering::Release);
        loop {
            // Acquire: pairs with the poller's Release after its last look at the table.
            if drained.load(Ordering::Acquire) {
                return true;
            }
            // A finished poller tore down what it had posted (or leaves it to its fabric's
            // drop, right after): nothing of it runs any more.
            let finished = self.shared.rounds.finished();
            if finished || Instant::now() >= deadline {
                let mut drains = lock(&self.shared.drains);
                if let Some(index) = drains
                    .iter()
                    .position(|drain| Arc::ptr_eq(&drain.drained, &drained))
                {
                    drains.remove(index);
                    self.shared.drains_pending.fetch_sub(1, Ordering::Relaxed);
                }
                return finished || drained.load(Ordering::Acquire);
            }
            if let Some(thread) = self.shared.thread.get() {
                thread.unpark();
            }
            thread::yield_now();
        }
    }

    /// The poller's counters now. Lock-free.
    pub fn counters(&self) -> CounterSnapshot {
        let c = &self.shared.counters;
        CounterSnapshot {
            posted: c.posted.get(),
            completed: c.completed.get(),
            failed: std::array::from_fn(|i| c.failed[i].get()),
            reprepared: c.reprepared.get(),
            stale_dropped: c.stale_dropped.get(),
            idle_rounds: c.idle_rounds.get(),
            busy_rounds: c.busy_rounds.get(),
            in_flight: c.in_flight.get(),
            ignored_completions: c.ignored_completions.get(),
            events_coalesced: c.events_coalesced.get(),
            unflushed: c.unflushed.get(),
            doorbells: c.doorbells.get(),
            credit_waits: c.credit_waits.get(),
            send_queue_full: c.send_queue_full.get(),
            load_bytes: c.load_bytes.get(),
            rail_downs: c.rail_downs.get(),
            rail_ups: c.rail_ups.get(),
        }
    }

    /// Shuts the poller down and waits for its thread: every slice it held is resolved.
    /// Idempotent.
    pub fn shutdown(&self) {
        // The flag, not a command: a full command ring cannot hold the shutdown back.
        self.shared.stop_requested.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(thread) = lock(&self.thread).take() {
            if thread.join().is_err() {
                // The poller panicked: a bug. Its slices were resolved by their Drop.
                tracing::error!(target: "railyard::poller", rail = %self.name, "the poller panicked");
            }
        }
    }
}

impl Drop for PollerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl std::fmt::Debug for PollerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollerHandle")
            .field("name", &self.name)
            .finish()
    }
}

/// Where an endpoint's queue pair stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Up(QpNum),
    /// The queue pair failed or could not connect; waiting for a newer epoch.
    Down,
    Retired,
}

#[derive(Debug)]
struct Endpoint {
    epoch: Epoch,
    link: Link,
    backlog: VecDeque<Slice>,
    /// Slices in `backlog` that arrived while it was down (not admitted before): what
    /// [`PollerConfig::backlog_limit`] bounds.
    fresh_in_backlog: usize,
    /// Work requests in flight on any of its queue pairs (old ones' flushes included).
    in_flight: usize,
    /// Its credits on its current queue pair.
    credits: Credits,
    /// Slices for the current queue pair waiting for credits, in order.
    waiting: VecDeque<Slice>,
    /// Listed in `Poller::starved` (set when it is put there, cleared when taken off).
    listed: bool,
    /// Fail everything at once with `PeerUnavailable`.
    circuit_open: bool,
    /// A success was reported for the current epoch ([`Event::Confirmed`]).
    confirmed: bool,
    /// What slices fail with once retired.
    retired_reason: FailReason,
    /// The newest queue pair a work-request error took down: the slices flushed behind that
    /// error are innocent, and are retried without being charged to their budgets.
    failed_by_work_request: Option<QpNum>,
}

/// The fabric is the first field: when a panic unwinds the poller, the fabric (and with it
/// every queue pair and posted request) is gone before the slices it held resolve.
struct Poller<F: Fabric> {
    fabric: F,
    reprepare: Box<dyn Reprepare>,
    shared: Arc<PollerShared>,
    control: Consumer<Control>,
    events: Producer<Event>,
    submissions: Vec<Consumer<Slice>>,
    /// Indexed by `EndpointId`.
    endpoints: Vec<Option<Endpoint>>,
    /// Slices taken from rings or handed back for a retry, not yet routed.
    ready: VecDeque<Slice>,
    inflight: Inflight<Slice>,
    /// How much the fabric holds at once: the credits.
    limits: FabricLimits,
    /// This round's work requests, per queue pair: one post call (doorbell) each.
    posts: Vec<(QpNum, Vec<WorkRequest>)>,
    /// Emptied lists of `posts`, reused.
    spare_lists: Vec<Vec<WorkRequest>>,
    /// Endpoints with slices waiting for credits.
    starved: Vec<EndpointId>,
    completions: Vec<WorkCompletion>,
    /// Events waiting for room in the event ring, the latest per endpoint.
    pending_events: BTreeMap<EndpointId, Event>,
    /// Scratch for the deadline sweep: queue pairs holding overdue work.
    overdue: Vec<(EndpointId, QpNum)>,
    sweep: SweepClock,
    /// Set by a shutdown command: failures now resolve as `Shutdown`.
    stopping: bool,
    config: PollerConfig,
}

/// The endpoint `id` of a poller's table. A free function so that the caller can keep using
/// the poller's other fields while it holds the endpoint.
fn endpoint_mut(endpoints: &mut [Option<Endpoint>], id: EndpointId) -> Option<&mut Endpoint> {
    endpoints.get_mut(id.0 as usize).and_then(Option::as_mut)
}

impl<F: Fabric> Poller<F> {
    fn run(mut self) {
        let mut idle_rounds = 0u32;
        loop {
            // Submissions before commands: a slice prepared for an epoch the control plane
            // announced was pushed after that epoch's command, so once the slice is here
            // the command is visible too (see the loom model of the hand-off).
            self.shared.rounds.begin();
            let mut busy = self.drain_submissions();
            if !self.pending_events.is_empty() {
                busy |= self.flush_events();
            }
            let (commands, shutdown) = self.apply_control();
            // Acquire: pairs with `shutdown`'s Release (nothing else to order; cheap).
            if shutdown || self.shared.stop_requested.load(Ordering::Acquire) {
                self.shut_down();
                return;
            }
            busy |= commands;
            busy |= self.route_ready();
            busy |= self.poll_completions();
            busy |= self.fabric.serve();
            busy |= self.poll_fabric_events();
            self.sweep_deadlines();
            self.answer_drains();
            self.shared.rounds.end();
            if busy {
                idle_rounds = 0;
                let counters = &self.shared.counters;
                counters.busy_rounds.add(1);
                counters.in_flight.set(self.inflight.busy() as u64);
            } else {
                idle_rounds = idle_rounds.saturating_add(1);
                self.shared.counters.idle_rounds.add(1);
                self.idle(idle_rounds);
            }
        }
    }

    fn idle(&mut self, idle_rounds: u32) {
        match self.config.idle {
            IdleStrategy::BusySpin => std::hint::spin_loop(),
            IdleStrategy::SpinThenYield { spins } => {
                if idle_rounds < spins {
                    std::hint::spin_loop();
                } else {
                    thread::yield_now();
                }
            }
            IdleStrategy::SpinThenPark { spins, park } => {
                if idle_rounds < spins {
                    std::hint::spin_loop();
                } else if self.inflight.busy() > 0 || self.fabric.serving() {
                    thread::yield_now();
                } else {
                    self.shared.parked.store(true, Ordering::Relaxed);
                    // SeqCst fence: pairs with `PollerShared::wake` (see there).
                    fence(Ordering::SeqCst);
                    if !self.has_input() {
                        thread::park_timeout(park);
                    }
                    self.shared.parked.store(false, Ordering::Relaxed);
                }
            }
        }
    }

    fn has_input(&mut self) -> bool {
        !self.control.is_empty() || self.submissions.iter_mut().any(|ring| !ring.is_empty())
    }

    /// Reports `event`; with the ring full it waits (replacing an older waiting event of the
    /// same endpoint, whose state it supersedes) and goes out in a later round.
    fn emit(&mut self, mut event: Event) {
        if self.pending_events.is_empty() {
            match self.events.push(event) {
                Ok(()) => return,
                Err(full) => event = full.into_inner(),
            }
        }
        if self
            .pending_events
            .insert(event.endpoint(), event)
            .is_some()
        {
            self.shared.counters.events_coalesced.add(1);
        }
    }

    /// Moves waiting events into the ring while it has room. True when any moved.
    fn flush_events(&mut self) -> bool {
        let mut moved = false;
        while let Some(entry) = self.pending_events.first_entry() {
            let endpoint = *entry.key();
            if let Err(full) = self.events.push(entry.remove()) {
                self.pending_events.insert(endpoint, full.into_inner());
                break;
            }
            moved = true;
        }
        moved
    }

    fn fail(&self, slice: Slice, reason: FailReason) {
        self.shared.counters.failed[reason.index()].add(1);
        self.shared.counters.load_bytes.sub(u64::from(slice.len));
        slice.resolve(Err(reason));
    }

    /// Applies queued commands. Returns (did work, shutdown requested).
    fn apply_control(&mut self) -> (bool, bool) {
        let mut busy = false;
        while let Some(control) = self.control.pop() {
            busy = true;
            match control {
                Control::AddSubmitter(ring) => self.submissions.push(ring),
                Control::Command(Command::Shutdown) => return (true, true),
                Control::Command(Command::AddEndpoint { endpoint, epoch }) => {
                    if self
                        .endpoint(endpoint)
                        .is_some_and(|e| e.link != Link::Retired)
                    {
                        self.bump_epoch(endpoint, epoch);
                    } else {
                        self.add_endpoint(endpoint, epoch);
                    }
                }
                Control::Command(Command::BumpEpoch { endpoint, epoch }) => {
                    self.bump_epoch(endpoint, epoch);
                }
                Control::Command(Command::RetireEndpoint { endpoint, reason }) => {
                    self.retire(endpoint, reason);
                }
                Control::Command(Command::SetCircuit { endpoint, open }) => {
                    self.set_circuit(endpoint, open);
                }
                Control::Command(Command::Unreachable { endpoint }) => {
                    self.set_circuit(endpoint, true);
                    let current = self.endpoint(endpoint).and_then(|e| match e.link {
                        Link::Up(qp) => Some(qp),
                        _ => None,
                    });
                    if let Some(qp) = current {
                        // Its flush finds the circuit open: PeerUnavailable.
                        self.take_down(endpoint, qp);
                    }
                }
            }
        }
        (busy, false)
    }

    fn endpoint(&self, id: EndpointId) -> Option<&Endpoint> {
        self.endpoints.get(id.0 as usize).and_then(Option::as_ref)
    }

    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Link {
        match self.fabric.connect(endpoint, epoch) {
            Ok(qp) => Link::Up(qp),
            Err(error) => {
                let reason = match error {
                    FabricError::Connect { reason, .. } => reason,
                    other => other.to_string(),
                };
                self.emit(Event::ConnectFailed {
                    endpoint,
                    epoch,
                    reason,
                });
                Link::Down
            }
        }
    }

    fn add_endpoint(&mut self, id: EndpointId, epoch: Epoch) {
        let link = self.connect(id, epoch);
        let index = id.0 as usize;
        if self.endpoints.len() <= index {
            self.endpoints.resize_with(index + 1, || None);
        }
        let in_flight = self.endpoint(id).map_or(0, |e| e.in_flight);
        self.endpoints[index] = Some(Endpoint {
            epoch,
            link,
            backlog: VecDeque::new(),
            fresh_in_backlog: 0,
            in_flight,
            credits: Credits::default(),
            waiting: VecDeque::new(),
            listed: false,
            circuit_open: false,
            confirmed: false,
            retired_reason: FailReason::EndpointRetired,
            failed_by_work_request: None,
        });
    }

    fn bump_epoch(&mut self, id: EndpointId, epoch: Epoch) {
        let Some(current) = self.endpoint(id) else {
            return;
        };
        if current.link == Link::Retired || !epoch.is_newer_than(current.epoch) {
            return;
        }
        if let Link::Up(old) = current.link {
            self.fabric.retire(old);
        }
        let link = self.connect(id, epoch);
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.epoch = epoch;
        endpoint.link = link;
        endpoint.confirmed = false;
        endpoint.credits.reset();
        // The backlog goes through the epoch rule again, ahead of newer work (and the
        // slices that waited for the old queue pair's credits ahead of it).
        let backlog = std::mem::take(&mut endpoint.backlog);
        endpoint.fresh_in_backlog = 0;
        for slice in backlog.into_iter().rev() {
            self.ready.push_front(slice);
        }
        self.requeue_waiting(id);
    }

    /// The slices of `id` that waited for credits of a queue pair it no longer has go
    /// through the epoch rule again, ahead of newer work.
    fn requeue_waiting(&mut self, id: EndpointId) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        let waiting = std::mem::take(&mut endpoint.waiting);
        for slice in waiting.into_iter().rev() {
            self.ready.push_front(slice);
        }
    }

    fn retire(&mut self, id: EndpointId, reason: FailReason) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        if let Link::Up(qp) = endpoint.link {
            self.fabric.retire(qp);
        }
        endpoint.link = Link::Retired;
        endpoint.retired_reason = reason;
        endpoint.credits.reset();
        let mut backlog = std::mem::take(&mut endpoint.backlog);
        endpoint.fresh_in_backlog = 0;
        backlog.append(&mut endpoint.waiting);
        let drained = endpoint.in_flight == 0;
        for slice in backlog {
            self.fail(slice, reason);
        }
        if drained {
            self.emit(Event::EndpointDrained { endpoint: id });
        }
    }

    fn set_circuit(&mut self, id: EndpointId, open: bool) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.circuit_open = open;
        if open {
            let mut backlog = std::mem::take(&mut endpoint.backlog);
            endpoint.fresh_in_backlog = 0;
            backlog.append(&mut endpoint.waiting);
            for slice in backlog {
                self.fail(slice, FailReason::PeerUnavailable);
            }
        }
    }

    fn drain_submissions(&mut self) -> bool {
        let mut busy = false;
        let mut index = 0;
        while index < self.submissions.len() {
            let ring = &mut self.submissions[index];
            let before = self.ready.len();
            if ring.pop_into(&mut self.ready, self.config.max_batch) > 0 {
                busy = true;
                let bytes = self.ready.range(before..).map(|s| u64::from(s.len)).sum();
                self.shared.counters.load_bytes.add(bytes);
            }
            if ring.is_abandoned() && ring.is_empty() {
                self.submissions.swap_remove(index);
            } else {
                index += 1;
            }
        }
        busy
    }

    /// Posts what waited for credits and has them now, then applies the epoch rule to every
    /// ready slice and posts those that pass: one post call per queue pair.
    fn route_ready(&mut self) -> bool {
        if self.ready.is_empty() && self.starved.is_empty() {
            return false;
        }
        let now = Instant::now();
        let mut busy = self.release_credits(now);
        while let Some(slice) = self.ready.pop_front() {
            busy = true;
            self.route(slice, now);
        }
        self.flush_posts();
        busy
    }

    /// Posts the waiting slices of starved endpoints while their queue pairs and the rail
    /// have credits: in order per endpoint, one slice per endpoint in turn, so that the
    /// rail's credits are shared and no endpoint waits behind another's long queue. True
    /// when any was posted or failed.
    fn release_credits(&mut self, now: Instant) -> bool {
        let mut moved = false;
        let mut turn: VecDeque<EndpointId> = std::mem::take(&mut self.starved).into();
        while let Some(id) = turn.pop_front() {
            let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
                continue;
            };
            let Link::Up(qp) = endpoint.link else {
                // Its queue pair went: its slices went back through the epoch rule then.
                endpoint.listed = false;
                continue;
            };
            if endpoint.waiting.is_empty() {
                endpoint.listed = false;
                continue;
            }
            if !endpoint
                .credits
                .available(self.inflight.busy(), self.limits)
            {
                // Still listed: it waits for its completions (or the rail's).
                self.starved.push(id);
                continue;
            }
            let Some(slice) = endpoint.waiting.pop_front() else {
                continue;
            };
            moved = true;
            if now >= slice.deadline() {
                self.fail(slice, FailReason::Timeout);
            } else {
                self.post(qp, slice);
            }
            turn.push_back(id);
        }
        moved
    }

    fn route(&mut self, mut slice: Slice, now: Instant) {
        if now >= slice.deadline() {
            return self.fail(slice, FailReason::Timeout);
        }
        let id = slice.endpoint;
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return self.fail(slice, FailReason::UnknownEndpoint);
        };
        let state = match endpoint.link {
            Link::Retired => LinkState::Retired(endpoint.retired_reason),
            _ if endpoint.circuit_open => LinkState::CircuitOpen,
            Link::Up(_) => LinkState::Up,
            Link::Down => LinkState::Down,
        };
        let up = match endpoint.link {
            Link::Up(qp) => Some(qp),
            Link::Down | Link::Retired => None,
        };
        let mut route = epoch_rule(slice.epoch, endpoint.epoch, state);
        if route == Route::Reprepare && crate::sabotage::is_off(Protection::EpochCheck) {
            route = Route::Post;
        }
        let its_turn = endpoint.waiting.is_empty()
            && endpoint
                .credits
                .available(self.inflight.busy(), self.limits);
        let backlog = BacklogRoom {
            admitted_before: slice.flags & FLAG_ADMITTED != 0,
            fresh: endpoint.fresh_in_backlog,
            limit: self.config.backlog_limit,
        };
        match rule::place(route, up, its_turn, backlog) {
            Placement::Post(qp) => self.post(qp, slice),
            Placement::AwaitCredits => {
                self.shared.counters.credit_waits.add(1);
                slice.flags |= FLAG_ADMITTED;
                endpoint.waiting.push_back(slice);
                if !endpoint.listed {
                    endpoint.listed = true;
                    self.starved.push(id);
                }
            }
            Placement::Backlog { counted } => {
                endpoint.fresh_in_backlog += usize::from(counted);
                endpoint.backlog.push_back(slice);
            }
            Placement::Fail(reason) => self.fail(slice, reason),
            Placement::Reprepare => {
                let current = endpoint.epoch;
                let cause = if slice.flags & FLAG_WR_ERROR_SEEN != 0 {
                    RepairCause::AfterWorkRequestError
                } else {
                    RepairCause::StaleEpoch
                };
                let outcome = self.reprepare.reprepare(&mut slice, current, cause);
                match rule::after_reprepare(outcome, slice.epoch, current) {
                    Ok(()) => {
                        self.shared.counters.reprepared.add(1);
                        self.route(slice, now);
                    }
                    Err(reason) => {
                        self.shared.counters.stale_dropped.add(1);
                        self.fail(slice, reason);
                    }
                }
            }
        }
    }

    /// Adds `slice` to this round's list for `qp` (the caller checked its credits).
    fn post(&mut self, qp: QpNum, slice: Slice) {
        let request = WorkRequest {
            wr_id: WrId::new(0, 0),
            opcode: slice.opcode,
            local_addr: slice.local_addr,
            lkey: slice.lkey,
            remote_addr: slice.remote_addr,
            rkey: slice.rkey,
            len: slice.len,
            imm: slice.imm,
            signaled: true,
            epoch: slice.epoch,
        };
        let id = slice.endpoint;
        if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
            endpoint.in_flight += 1;
            endpoint.credits.take();
        }
        let wr_id = self.inflight.insert(slice, id, qp, request.lkey);
        let request = WorkRequest { wr_id, ..request };
        match self.posts.iter_mut().find(|(listed, _)| *listed == qp) {
            Some((_, list)) => list.push(request),
            None => {
                let mut list = self.spare_lists.pop().unwrap_or_default();
                list.push(request);
                self.posts.push((qp, list));
            }
        }
    }

    /// Posts this round's list of each queue pair: one doorbell each.
    fn flush_posts(&mut self) {
        let mut posts = std::mem::take(&mut self.posts);
        for (qp, mut list) in posts.drain(..) {
            self.post_list(qp, &list);
            list.clear();
            self.spare_lists.push(list);
        }
        self.posts = posts;
    }

    /// Posts `list` on `qp`. What a full send queue refuses waits, in order, at the front of
    /// its endpoint's queue for credits; what any other error refuses fails `PostFailed`.
    fn post_list(&mut self, qp: QpNum, list: &[WorkRequest]) {
        if list.is_empty() {
            return;
        }
        self.shared.counters.doorbells.add(1);
        let (accepted, full) = match self.fabric.post(qp, list) {
            Ok(()) => (list.len(), false),
            Err(error) => (
                error.posted.min(list.len()),
                matches!(error.error, FabricError::SendQueueFull { .. }),
            ),
        };
        self.shared.counters.posted.add(accepted as u64);
        if accepted == list.len() {
            return;
        }
        if full {
            self.shared.counters.send_queue_full.add(1);
        }
        // Back to front, so that pushing each to the front of the queue keeps their order.
        for request in list[accepted..].iter().rev() {
            let Some((id, _, slice)) = self.inflight.take(request.wr_id) else {
                continue;
            };
            self.note_landed(id);
            let endpoint = endpoint_mut(&mut self.endpoints, id);
            if let Some(endpoint) = endpoint {
                if endpoint.link == Link::Up(qp) {
                    endpoint.credits.refused();
                }
            }
            let Some(slice) = slice else { continue };
            if !full {
                self.fail(slice, FailReason::PostFailed);
                continue;
            }
            match endpoint_mut(&mut self.endpoints, id) {
                Some(endpoint) if endpoint.link == Link::Up(qp) => {
                    endpoint.credits.send_queue_is_full();
                    let mut slice = slice;
                    slice.flags |= FLAG_ADMITTED;
                    endpoint.waiting.push_front(slice);
                    if !endpoint.listed {
                        endpoint.listed = true;
                        self.starved.push(id);
                    }
                }
                // Its queue pair went meanwhile: through the epoch rule again.
                _ => self.ready.push_front(slice),
            }
        }
    }

    /// One of `endpoint`'s work requests is no longer in flight.
    fn note_landed(&mut self, id: EndpointId) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.in_flight = endpoint.in_flight.saturating_sub(1);
        if endpoint.in_flight == 0 && endpoint.link == Link::Retired {
            self.emit(Event::EndpointDrained { endpoint: id });
        }
    }

    fn poll_completions(&mut self) -> bool {
        if self.inflight.busy() == 0 {
            return false;
        }
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        let count = self.fabric.poll(&mut completions, self.config.max_batch);
        // Events first: a fatal queue pair is reported as such, not as its flushes.
        self.poll_fabric_events();
        for completion in completions.drain(..) {
            self.complete(completion);
        }
        self.completions = completions;
        count > 0
    }

    fn complete(&mut self, completion: WorkCompletion) {
        let Some((id, posted_on, slice)) = self.inflight.take(completion.wr_id) else {
            self.shared.counters.ignored_completions.add(1);
            return;
        };
        self.note_landed(id);
        if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
            if endpoint.link == Link::Up(posted_on) {
                endpoint.credits.completed();
            }
        }
        let status = completion.status;
        if status != WcStatus::Success {
            // A flush on a queue pair the poller did not retire means the fabric moved it
            // to ERR on its own; `queue_pair_failed` ignores replaced queue pairs.
            self.queue_pair_failed(id, completion.qp, status);
        }
        if status == WcStatus::Success {
            self.confirm(id, completion.qp);
        }
        // `None`: resolved without it when the fabric missed its flush grace.
        let Some(mut slice) = slice else { return };
        let Some(reason) = FailReason::from_status(status) else {
            self.shared.counters.completed.add(1);
            self.shared.counters.load_bytes.sub(u64::from(slice.len));
            return slice.resolve(Ok(()));
        };
        if slice.flags & FLAG_TIMED_OUT != 0 {
            return self.fail(slice, rule::timed_out_reason(status, reason));
        }
        if self.stopping {
            return self.fail(slice, FailReason::Shutdown);
        }
        let innocent = match self.endpoint(id) {
            None => return self.fail(slice, FailReason::EndpointRetired),
            Some(e) if e.link == Link::Retired => {
                let reason = e.retired_reason;
                return self.fail(slice, reason);
            }
            Some(e) if e.circuit_open => return self.fail(slice, FailReason::PeerUnavailable),
            // Flushed behind another slice's work-request error: not this slice's doing.
            Some(e) => {
                status == WcStatus::WrFlushErr && e.failed_by_work_request == Some(completion.qp)
            }
        };
        let retry = rule::retry_rule(FailedRequest {
            status,
            erred_before: slice.flags & FLAG_WR_ERROR_SEEN != 0,
            with_immediate: slice.opcode == Opcode::WriteWithImm,
            innocent,
            retries: slice.retries,
            budget: self.config.retry_budget,
        });
        if status.is_work_request_error() {
            slice.flags |= FLAG_WR_ERROR_SEEN;
        }
        match retry {
            Retry::Charged => {
                slice.retries += 1;
                self.ready.push_back(slice);
            }
            Retry::Free => self.ready.push_back(slice),
            Retry::No => self.fail(slice, reason),
        }
    }

    /// Reports the first success on endpoint `id`'s current queue pair.
    fn confirm(&mut self, id: EndpointId, qp: QpNum) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        if endpoint.confirmed || endpoint.link != Link::Up(qp) {
            return;
        }
        endpoint.confirmed = true;
        let epoch = endpoint.epoch;
        self.emit(Event::Confirmed {
            endpoint: id,
            epoch,
        });
    }

    /// An error completion moved `qp` to ERR: flush it and mark the endpoint down.
    fn queue_pair_failed(&mut self, id: EndpointId, qp: QpNum, status: WcStatus) {
        if status.is_work_request_error() {
            if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
                if endpoint.link == Link::Up(qp) {
                    endpoint.failed_by_work_request = Some(qp);
                }
            }
        }
        if let Some(epoch) = self.take_down(id, qp) {
            self.emit(Event::QpFailed {
                endpoint: id,
                epoch,
                status,
            });
        }
    }

    /// Marks endpoint `id` down and retires `qp` when `qp` is its current queue pair;
    /// returns the endpoint's epoch then. `None` for a queue pair already replaced.
    fn take_down(&mut self, id: EndpointId, qp: QpNum) -> Option<Epoch> {
        let endpoint = endpoint_mut(&mut self.endpoints, id)?;
        if endpoint.link != Link::Up(qp) {
            return None;
        }
        endpoint.link = Link::Down;
        endpoint.credits.reset();
        let epoch = endpoint.epoch;
        self.fabric.retire(qp);
        // What waited for its credits waits for the next queue pair instead.
        self.requeue_waiting(id);
        Some(epoch)
    }

    /// Applies the fabric's asynchronous events. Returns whether there were any.
    fn poll_fabric_events(&mut self) -> bool {
        let mut busy = false;
        while let Some(event) = self.fabric.poll_event() {
            busy = true;
            match event {
                AsyncEvent::QpFatal { qp } => {
                    let owner = self.endpoints.iter().position(|endpoint| {
                        endpoint.as_ref().is_some_and(|e| e.link == Link::Up(qp))
                    });
                    let Some(id) = owner.map(|index| EndpointId(index as u32)) else {
                        continue; // already retired or replaced
                    };
                    if let Some(epoch) = self.take_down(id, qp) {
                        self.emit(Event::QpFatal {
                            endpoint: id,
                            epoch,
                        });
                    }
                }
                // Its queue pairs come as QpFatal; new ones are refused while it is down
                // (the endpoints back off, and the engine sends their work elsewhere).
                AsyncEvent::RailDown { reason: _ } => self.shared.counters.rail_downs.add(1),
                AsyncEvent::RailUp => self.shared.counters.rail_ups.add(1),
            }
        }
        busy
    }

    /// Marks drained every [`PollerHandle::drain_local`] whose keys no posted request uses.
    fn answer_drains(&mut self) {
        // Acquire: pairs with `drain_local`'s Release.
        if self.shared.drains_pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut drains = lock(&self.shared.drains);
        drains.retain(|drain| {
            if self.inflight.uses_any(&drain.lkeys) {
                return true;
            }
            // Release: what the caller does next comes after the table was read.
            drain.drained.store(true, Ordering::Release);
            self.shared.drains_pending.fetch_sub(1, Ordering::Relaxed);
            false
        });
    }

    /// Fails backlogged slices whose deadline passed; takes the queue pairs of overdue posted
    /// slices out of service, so that the flush hands them back (see the module docs).
    fn sweep_deadlines(&mut self) {
        let now = Instant::now();
        if !self.sweep.due(now) {
            return;
        }
        let mut expired = Vec::new();
        for endpoint in self.endpoints.iter_mut().flatten() {
            for queue in [&mut endpoint.backlog, &mut endpoint.waiting] {
                deadline::take_expired(queue, now, Slice::deadline, &mut expired);
            }
            endpoint.fresh_in_backlog = endpoint
                .backlog
                .iter()
                .filter(|slice| slice.flags & FLAG_ADMITTED == 0)
                .count();
        }
        for slice in expired {
            self.fail(slice, FailReason::Timeout);
        }
        // Posted work cannot be recalled, only flushed: mark it and retire its queue pair.
        let mut overdue = std::mem::take(&mut self.overdue);
        let mut unflushed = Vec::new();
        for slot in self.inflight.posted_mut() {
            let Some(slice) = slot.slice.as_mut() else {
                continue;
            };
            let marked = slice.flags & FLAG_TIMED_OUT != 0;
            match deadline::overdue(slice.deadline(), marked, now, self.config.flush_grace) {
                Overdue::No => {}
                Overdue::TakeOutOfService => {
                    slice.flags |= FLAG_TIMED_OUT;
                    overdue.push((slot.endpoint, slot.qp));
                }
                Overdue::Unflushed => {
                    if !unflushed.contains(&slot.qp) {
                        unflushed.push(slot.qp);
                    }
                }
            }
        }
        for (id, qp) in overdue.drain(..) {
            // `None` for a queue pair already out of service: its flush is on its way.
            if let Some(epoch) = self.take_down(id, qp) {
                self.emit(Event::QpFailed {
                    endpoint: id,
                    epoch,
                    status: WcStatus::RetryExcErr,
                });
            }
        }
        self.overdue = overdue;
        for qp in unflushed {
            self.abandon(qp, now);
        }
    }

    /// Tears down `qp`, whose flush missed the grace ([`Fabric::abandon`]), and resolves the
    /// requests still posted on it as flushed: the overdue ones with `Timeout`, the others
    /// by the retry rule; each is counted as `unflushed`. A fabric that cannot promise to
    /// leave their memory alone has only the overdue ones resolved, and their slots wait
    /// for the completions (a local region's deregistration waits for those).
    fn abandon(&mut self, qp: QpNum, now: Instant) {
        if self.fabric.abandon(qp) {
            let flushed: Vec<WorkCompletion> = self
                .inflight
                .posted_on(qp)
                .filter_map(|(wr_id, slice)| {
                    let opcode = slice?.opcode;
                    Some(WorkCompletion::ended(
                        wr_id,
                        opcode,
                        0,
                        qp,
                        WcStatus::WrFlushErr,
                    ))
                })
                .collect();
            for completion in flushed {
                self.shared.counters.unflushed.add(1);
                self.complete(completion);
            }
            return;
        }
        tracing::warn!(
            target: "railyard::poller",
            qp = qp.0,
            "the fabric neither flushed nor can tear down a queue pair past its deadline: \
             its overdue requests are resolved while it may still move their bytes"
        );
        let grace = self.config.flush_grace;
        let overdue: Vec<Slice> = self
            .inflight
            .posted_mut()
            .filter(|slot| slot.qp == qp)
            .filter(|slot| {
                slot.slice.as_ref().is_some_and(|slice| {
                    let marked = slice.flags & FLAG_TIMED_OUT != 0;
                    deadline::overdue(slice.deadline(), marked, now, grace) == Overdue::Unflushed
                })
            })
            .filter_map(|slot| slot.slice.take())
            .collect();
        for slice in overdue {
            self.shared.counters.unflushed.add(1);
            self.fail(slice, FailReason::Timeout);
        }
    }

    /// Resolves everything and returns; what is pushed later is resolved by the pusher
    /// (see `Drop`).
    fn shut_down(mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        self.stopping = true;
        // Queued work fails; in-flight work is flushed and resolved by its completions.
        while self.drain_submissions() {}
        let mut queued: Vec<Slice> = self.ready.drain(..).collect();
        for endpoint in self.endpoints.iter_mut().flatten() {
            queued.extend(endpoint.backlog.drain(..));
            queued.extend(endpoint.waiting.drain(..));
            if let Link::Up(qp) = endpoint.link {
                self.fabric.retire(qp);
            }
            endpoint.link = Link::Retired;
        }
        for slice in queued {
            self.fail(slice, FailReason::Shutdown);
        }
        let grace_end = Instant::now() + self.config.flush_grace;
        while self.inflight.busy() > 0 && Instant::now() < grace_end {
            self.shared.rounds.begin();
            let moved = self.poll_completions();
            self.shared.rounds.end();
            if !moved {
                thread::yield_now();
            }
        }
        // What the fabric did not flush in time: torn down before it is resolved.
        let mut unflushed: Vec<QpNum> = Vec::new();
        for slot in self.inflight.posted_mut() {
            if !unflushed.contains(&slot.qp) {
                unflushed.push(slot.qp);
            }
        }
        for qp in unflushed {
            if !self.fabric.abandon(qp) {
                tracing::warn!(
                    target: "railyard::poller",
                    qp = qp.0,
                    "stopping: the fabric neither flushed nor can tear down a queue pair; \
                     its requests are resolved while it may still move their bytes"
                );
            }
        }
        let unflushed: Vec<Slice> = self
            .inflight
            .posted_mut()
            .filter_map(|slot| slot.slice.take())
            .collect();
        for slice in unflushed {
            self.shared.counters.unflushed.add(1);
            self.fail(slice, FailReason::Shutdown);
        }
    }
}

impl<F: Fabric> Drop for Poller<F> {
    /// However the thread ends (shutdown or panic): mark the poller stopped, resolve what
    /// its rings hold, and leave the rings where a late pusher finds them.
    fn drop(&mut self) {
        // Events still waiting get their last chance at the ring.
        self.flush_events();
        self.shared.stopped.store(true, Ordering::Release);
        // SeqCst fence: pairs with the one in `PollerShared::wake` (see there).
        fence(Ordering::SeqCst);
        let (_, closed) = ring::channel(1);
        let mut orphans = lock(&self.shared.orphans);
        orphans.control = Some(std::mem::replace(&mut self.control, closed));
        orphans.rings.append(&mut self.submissions);
        orphans.resolve_leftovers();
        drop(orphans);
        // The fabric goes with the rest of the poller right after this: a quiescing caller
        // may go on (nothing the poller checked is acted on any more).
        self.shared.rounds.finish();
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use std::collections::VecDeque;

    use loom::thread;

    use super::rule::{LinkState, Route, epoch_rule};
    use crate::Epoch;
    use crate::ring::{self, Producer};
    use crate::sync::{Arc, AtomicUsize, Ordering};

    fn push(ring: &mut Producer<u64>, mut value: u64) {
        while let Err(full) = ring.push(value) {
            value = full.into_inner();
            thread::yield_now();
        }
    }

    /// The control/poller hand-off of a connect and a reconnect, in the order the control
    /// plane uses: send the command (AddEndpoint at epoch 1, then BumpEpoch to 2) first,
    /// then publish the epoch to submitters (the endpoint view). A submitter reads the view
    /// twice and prepares a slice from each epoch it finds (none before the first); the
    /// poller runs its real loop order (drain submissions, then apply commands, then route)
    /// with the real epoch rule and a re-prepare hook that stamps the current epoch. In every
    /// interleaving no slice meets an endpoint the poller does not know yet, each is posted
    /// exactly once, on a queue pair of exactly the epoch it carries, and nothing is left
    /// waiting. (Publishing the epoch before sending the command fails this model.)
    #[test]
    fn loom_epoch_hand_off_never_posts_a_stale_slice() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let view = Arc::new(AtomicUsize::new(0));
            let finished = Arc::new(AtomicUsize::new(0));
            let (mut commands_tx, mut commands) = ring::channel::<u64>(2);
            let (mut slices_tx, mut slices) = ring::channel::<u64>(2);
            let (control_view, control_finished) = (view.clone(), finished.clone());
            let control = thread::spawn(move || {
                for epoch in [1, 2] {
                    push(&mut commands_tx, epoch);
                    control_view.store(epoch as usize, Ordering::Release);
                }
                control_finished.fetch_add(1, Ordering::Release);
            });
            let submitter_finished = finished.clone();
            let submitter = thread::spawn(move || {
                let mut sent = 0;
                for _ in 0..2 {
                    let epoch = view.load(Ordering::Acquire);
                    if epoch != 0 {
                        push(&mut slices_tx, epoch as u64);
                        sent += 1;
                    }
                }
                submitter_finished.fetch_add(1, Ordering::Release);
                sent
            });
            let mut endpoint: Option<Epoch> = None;
            let mut backlog: Vec<u64> = Vec::new();
            let mut ready: VecDeque<u64> = VecDeque::new();
            let mut posted: Vec<(Epoch, Epoch)> = Vec::new();
            loop {
                let both_done = finished.load(Ordering::Acquire) == 2;
                while let Some(epoch) = slices.pop() {
                    ready.push_back(epoch);
                }
                while let Some(epoch) = commands.pop() {
                    endpoint = Some(Epoch::new(epoch));
                    ready.extend(backlog.drain(..));
                }
                while let Some(epoch) = ready.pop_front() {
                    let Some(current) = endpoint else {
                        panic!("a slice reached the poller before its endpoint");
                    };
                    let mut slice = Epoch::new(epoch);
                    loop {
                        match epoch_rule(slice, current, LinkState::Up) {
                            Route::Post => {
                                posted.push((slice, current));
                                break;
                            }
                            Route::Wait => {
                                backlog.push(slice.get());
                                break;
                            }
                            Route::Reprepare => slice = current,
                            Route::Fail(reason) => {
                                panic!("an up endpoint failed a slice: {reason}")
                            }
                        }
                    }
                }
                if both_done {
                    break;
                }
                thread::yield_now();
            }
            control.join().unwrap();
            let sent = submitter.join().unwrap();
            assert!(backlog.is_empty(), "a slice was left waiting");
            assert_eq!(posted.len(), sent);
            for (slice, queue_pair) in posted {
                assert_eq!(slice, queue_pair, "posted on a queue pair of another epoch");
            }
        });
    }
}
