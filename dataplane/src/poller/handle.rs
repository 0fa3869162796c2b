//! The owner's handle to a poller: starting its thread, sending it commands, registering
//! submitters, waiting for its rounds and local drains, reading its counters, and stopping it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::config::PollerConfig;
use super::counters::CounterSnapshot;
use super::messages::{Command, Event};
use super::reprepare::Reprepare;
use super::shared::{Control, LocalDrain, PollerShared, lock};
use super::state::Poller;
use crate::fabric::Fabric;
use crate::ring::{self, Consumer, Producer};
use crate::slice::Slice;

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
        let poller = Poller::new(
            config.clone(),
            fabric,
            Box::new(reprepare),
            shared.clone(),
            control_rx,
            events_tx,
        );
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
        self.shared.counters.snapshot()
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
