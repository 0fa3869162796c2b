//! What a poller holds: its endpoints and their queue pairs, the slices waiting to be routed
//! or for credits, the table of posted work, and this round's posts.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::config::PollerConfig;
use super::credits::Credits;
use super::deadline::SweepClock;
use super::inflight::Inflight;
use super::messages::Event;
use super::reprepare::Reprepare;
use super::shared::{Control, PollerShared};
use crate::batch::FailReason;
use crate::fabric::{Fabric, FabricLimits, QpNum, WorkCompletion, WorkRequest};
use crate::ring::{Consumer, Producer};
use crate::slice::Slice;
use crate::{EndpointId, Epoch};

/// Where an endpoint's queue pair stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Link {
    Up(QpNum),
    /// The queue pair failed or could not connect; waiting for a newer epoch.
    Down,
    /// Idle, its queue pair freed for another endpoint ([`Command::Park`]); waiting for a
    /// newer epoch, asked for ([`Event::Wanted`]) when a slice arrives.
    ///
    /// [`Command::Park`]: super::messages::Command::Park
    Parked {
        /// [`Event::Wanted`] was reported since it was parked.
        wanted: bool,
    },
    Retired,
}

#[derive(Debug)]
pub(super) struct Endpoint {
    pub(super) epoch: Epoch,
    pub(super) link: Link,
    pub(super) backlog: VecDeque<Slice>,
    /// Slices in `backlog` that arrived while it was down (not admitted before): what
    /// [`PollerConfig::backlog_limit`] bounds.
    pub(super) fresh_in_backlog: usize,
    /// Work requests in flight on any of its queue pairs (old ones' flushes included).
    pub(super) in_flight: usize,
    /// Its credits on its current queue pair.
    pub(super) credits: Credits,
    /// Slices for the current queue pair waiting for credits, in order.
    pub(super) waiting: VecDeque<Slice>,
    /// Listed in `Poller::starved` (set when it is put there, cleared when taken off).
    pub(super) listed: bool,
    /// Fail everything at once with `PeerUnavailable`.
    pub(super) circuit_open: bool,
    /// A success was reported for the current epoch ([`Event::Confirmed`]).
    pub(super) confirmed: bool,
    /// What slices fail with once retired.
    pub(super) retired_reason: FailReason,
    /// The newest queue pair a work-request error took down: the slices flushed behind that
    /// error are innocent, and are retried without being charged to their budgets.
    pub(super) failed_by_work_request: Option<QpNum>,
}

impl Endpoint {
    /// Nothing of it is queued, waiting for credits or in flight.
    pub(super) fn is_idle(&self) -> bool {
        self.in_flight == 0 && self.backlog.is_empty() && self.waiting.is_empty()
    }
}

/// The fabric is the first field: when a panic unwinds the poller, the fabric (and with it
/// every queue pair and posted request) is gone before the slices it held resolve.
pub(super) struct Poller<F: Fabric> {
    pub(super) fabric: F,
    pub(super) reprepare: Box<dyn Reprepare>,
    pub(super) shared: Arc<PollerShared>,
    pub(super) control: Consumer<Control>,
    pub(super) events: Producer<Event>,
    pub(super) submissions: Vec<Consumer<Slice>>,
    /// Indexed by `EndpointId`.
    pub(super) endpoints: Vec<Option<Endpoint>>,
    /// Slices taken from rings or handed back for a retry, not yet routed.
    pub(super) ready: VecDeque<Slice>,
    pub(super) inflight: Inflight<Slice>,
    /// How much the fabric holds at once: the credits.
    pub(super) limits: FabricLimits,
    /// This round's work requests, per queue pair: one post call (doorbell) each.
    pub(super) posts: Vec<(QpNum, Vec<WorkRequest>)>,
    /// Emptied lists of `posts`, reused.
    pub(super) spare_lists: Vec<Vec<WorkRequest>>,
    /// Endpoints with slices waiting for credits.
    pub(super) starved: Vec<EndpointId>,
    pub(super) completions: Vec<WorkCompletion>,
    /// Events waiting for room in the event ring, the latest per endpoint.
    pub(super) pending_events: BTreeMap<EndpointId, Event>,
    /// Scratch for the deadline sweep: queue pairs holding overdue work.
    pub(super) overdue: Vec<(EndpointId, QpNum)>,
    pub(super) sweep: SweepClock,
    /// Set by a shutdown command: failures now resolve as `Shutdown`.
    pub(super) stopping: bool,
    pub(super) config: PollerConfig,
}

/// The endpoint `id` of a poller's table. A free function so that the caller can keep using
/// the poller's other fields while it holds the endpoint.
pub(super) fn endpoint_mut(
    endpoints: &mut [Option<Endpoint>],
    id: EndpointId,
) -> Option<&mut Endpoint> {
    endpoints.get_mut(id.0 as usize).and_then(Option::as_mut)
}

impl<F: Fabric> Poller<F> {
    /// A poller driving `fabric`, with no endpoints and no submission rings yet.
    pub(super) fn new(
        config: PollerConfig,
        fabric: F,
        reprepare: Box<dyn Reprepare>,
        shared: Arc<PollerShared>,
        control: Consumer<Control>,
        events: Producer<Event>,
    ) -> Self {
        let limits = fabric.limits();
        Self {
            // A queue of no entries would hold every slice until its deadline.
            limits: FabricLimits {
                send_queue: limits.send_queue.max(1),
                completion_queue: limits.completion_queue.max(1),
            },
            fabric,
            reprepare,
            shared,
            control,
            events,
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
            config,
        }
    }

    pub(super) fn endpoint(&self, id: EndpointId) -> Option<&Endpoint> {
        self.endpoints.get(id.0 as usize).and_then(Option::as_ref)
    }
}
