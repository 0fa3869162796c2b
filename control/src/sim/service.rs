//! Services simulated beside the control plane: another crate's sans-IO state machine (the
//! store's master) run on the same clock, against the same processes and their faults, in
//! the same trace. The world owns the time, the processes and the event queue; a service
//! owns its own state and is called when something it asked for or depends on happens.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A state machine simulated beside the control plane. Each call gets the world's view
/// ([`ServiceWorld`]): the time, the processes, the network's partitions, and ways to ask
/// for a wake-up, trace an event and report a violation.
pub trait SimService {
    /// The run starts: every process is up.
    fn start(&mut self, world: &mut ServiceWorld<'_>);

    /// A wake-up asked for with [`ServiceWorld::wake_after`], with its token.
    fn wake(&mut self, token: u64, world: &mut ServiceWorld<'_>);

    /// Process `slot` was killed, restarted (a new incarnation), stopped or resumed.
    fn process_changed(&mut self, slot: usize, world: &mut ServiceWorld<'_>);

    /// The run is over (checks due at the end go here): its figures, by name.
    fn finish(&mut self, world: &mut ServiceWorld<'_>) -> Vec<(&'static str, f64)>;
}

/// Makes a service for a run, given its seed and how long it runs.
type MakeService = dyn Fn(u64, Duration) -> Box<dyn SimService> + Send + Sync;

/// Makes a fresh service for each run of a configuration (shrinking runs it many times).
#[derive(Clone)]
pub struct ServiceFactory {
    /// Its name, in reports.
    pub name: &'static str,
    make: Arc<MakeService>,
}

impl ServiceFactory {
    /// A factory named `name` that calls `make` with the run's seed and duration.
    pub fn new(
        name: &'static str,
        make: impl Fn(u64, Duration) -> Box<dyn SimService> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            make: Arc::new(make),
        }
    }

    pub(super) fn make(&self, seed: u64, duration: Duration) -> Box<dyn SimService> {
        (self.make)(seed, duration)
    }
}

impl fmt::Debug for ServiceFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceFactory")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl PartialEq for ServiceFactory {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && Arc::ptr_eq(&self.make, &other.make)
    }
}

/// What a service's run reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceReport {
    /// The service.
    pub name: &'static str,
    /// Its figures, by name.
    pub figures: Vec<(&'static str, f64)>,
}

/// A process as a service sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessView {
    /// Its current incarnation (a restart makes a new one).
    pub incarnation: u64,
    /// Running (not killed; it may be stopped).
    pub up: bool,
    /// Stopped (SIGSTOP): it keeps its memory and sockets and does nothing.
    pub stopped: bool,
}

/// What the world offers its services (the world implements it; a service sees it through
/// [`ServiceWorld`]).
pub(super) trait Host {
    fn elapsed(&self) -> Duration;
    fn instant_now(&self) -> Instant;
    fn latency_range(&self) -> (Duration, Duration);
    fn connection_loss(&self) -> f64;
    fn process_count(&self) -> usize;
    fn process_view(&self, slot: usize) -> ProcessView;
    fn partitioned(&self, a: usize, b: usize) -> bool;
    fn wake_service(&mut self, service: usize, delay: Duration, token: u64);
    fn trace_event(
        &mut self,
        slot: usize,
        what: &'static str,
        fields: &[u64],
        line: Box<dyn FnOnce() -> String + '_>,
    );
    fn report_violation(&mut self, invariant: &'static str, detail: String);
}

/// The world, as a service's call sees it.
pub struct ServiceWorld<'w> {
    pub(super) world: &'w mut dyn Host,
    pub(super) service: usize,
}

impl ServiceWorld<'_> {
    /// Simulated time since the start.
    pub fn now(&self) -> Duration {
        self.world.elapsed()
    }

    /// Simulated time as an instant (what sans-IO cores are fed).
    pub fn instant(&self) -> Instant {
        self.world.instant_now()
    }

    /// The shortest and longest one-way latency of the simulated network.
    pub fn latency_range(&self) -> (Duration, Duration) {
        self.world.latency_range()
    }

    /// Probability that a message is lost, which resets its TCP connection
    /// ([`super::NetFaults::loss`]).
    pub fn connection_loss(&self) -> f64 {
        self.world.connection_loss()
    }

    /// Processes (slots), killed ones included.
    pub fn processes(&self) -> usize {
        self.world.process_count()
    }

    /// Process `slot` now.
    pub fn process(&self, slot: usize) -> ProcessView {
        self.world.process_view(slot)
    }

    /// Whether a partition separates processes `a` and `b` now.
    pub fn partitioned(&self, a: usize, b: usize) -> bool {
        self.world.partitioned(a, b)
    }

    /// Calls [`SimService::wake`] with `token` after `delay`.
    pub fn wake_after(&mut self, delay: Duration, token: u64) {
        self.world.wake_service(self.service, delay, token);
    }

    /// Folds an event into the run's trace (and keeps its line when lines are kept).
    pub fn trace(
        &mut self,
        slot: usize,
        what: &'static str,
        fields: &[u64],
        line: impl FnOnce() -> String,
    ) {
        self.world.trace_event(slot, what, fields, Box::new(line));
    }

    /// Reports that `invariant` broke.
    pub fn violation(&mut self, invariant: &'static str, detail: String) {
        self.world.report_violation(invariant, detail);
    }
}
