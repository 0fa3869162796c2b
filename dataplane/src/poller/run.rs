//! The poller's loop: the order of a round's steps, idling, reporting events, taking in
//! submissions, answering local drains, and resolving everything when it stops.

use std::sync::atomic::{Ordering, fence};
use std::thread;
use std::time::Instant;

use super::config::IdleStrategy;
use super::messages::Event;
use super::shared::lock;
use super::state::{Link, Poller};
use crate::batch::FailReason;
use crate::fabric::{Fabric, QpNum};
use crate::ring;
use crate::slice::Slice;

impl<F: Fabric> Poller<F> {
    pub(super) fn run(mut self) {
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
    pub(super) fn emit(&mut self, mut event: Event) {
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

    pub(super) fn fail(&self, slice: Slice, reason: FailReason) {
        self.shared.counters.failed[reason.index()].add(1);
        self.shared.counters.load_bytes.sub(u64::from(slice.len));
        slice.resolve(Err(reason));
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

    /// Marks drained every [`PollerHandle::drain_local`] whose keys no posted request uses.
    ///
    /// [`PollerHandle::drain_local`]: super::PollerHandle::drain_local
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
