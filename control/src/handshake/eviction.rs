//! Bounded queue pairs per rail: at most [`Policy::max_endpoints_per_rail`] endpoints of a
//! rail hold (or are connecting) a queue pair. An endpoint that needs one beyond that waits
//! for room, and room is made by parking idle endpoints, least recently wanted first.
//!
//! Only the poller knows whether an endpoint is idle, so the core asks it
//! ([`Command::Park`]) and the poller frees the queue pair only if nothing of the endpoint
//! is queued, waiting or in flight ([`Event::Parked`]); a busy one keeps it
//! ([`Event::ParkRefused`]) and the next candidate is asked at the next tick. A parked
//! endpoint stays what the application holds — its view, its id, its phase — and when a
//! slice arrives for it the poller keeps the slice and says so ([`Event::Wanted`]): the
//! endpoint connects a queue pair at its next epoch and the slice, re-prepared by the epoch
//! rule, goes out on it. Nothing fails because of an eviction.
//!
//! [`Policy::max_endpoints_per_rail`]: crate::policy::Policy::max_endpoints_per_rail

use std::time::{Duration, Instant};

use railyard_dataplane::{Command, EndpointId, Epoch};

use super::state::{Action, Core};
use crate::endpoint::{Input, Phase};
use crate::rail::RailFabric;
use crate::shared::bump;

/// How often endpoints waiting for room look for idle endpoints to park again.
pub(super) const PARK_RETRY: Duration = Duration::from_millis(10);

/// How long a park may go unanswered before it is taken as lost and asked again.
const PARK_ANSWER_WAIT: Duration = Duration::from_secs(1);

impl<F: RailFabric> Core<F> {
    /// Endpoints of `rail` holding or connecting a queue pair: neither retired, parked nor
    /// waiting for room.
    pub(crate) fn queue_pairs_on(&self, rail: u16) -> usize {
        self.active
            .iter()
            .filter(|((r, _), a)| {
                *r == rail && !a.parked && !a.wants_room && a.machine.phase() != Phase::Retired
            })
            .count()
    }

    /// Feeds `input` (ConnectWanted for a new endpoint, Wake for a parked one) to endpoint
    /// `id` of `rail` if the rail has room for its queue pair; otherwise the endpoint waits
    /// (in order) and idle endpoints are asked to park.
    pub(super) fn acquire_queue_pair(
        &mut self,
        rail: u16,
        id: EndpointId,
        input: Input,
        now: Instant,
    ) {
        // Counted without itself: a new endpoint is already in the table.
        let itself = self
            .active
            .get(&(rail, id))
            .is_some_and(|a| !a.parked && !a.wants_room && a.machine.phase() != Phase::Retired);
        let others = self.queue_pairs_on(rail) - usize::from(itself);
        let room = others < self.policy.max_endpoints_per_rail;
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        if room {
            // A park ends when the queue pair starts (`drive`, at CreateQp).
            active.wants_room = false;
            active.last_wanted = now;
            if input == Input::Wake {
                bump(&self.shared.counters.wakes);
            }
            return self.handle_input(rail, id, input, now);
        }
        if !active.wants_room {
            active.wants_room = true;
            bump(&self.shared.counters.endpoint_waits);
            self.room_wanted.push_back((rail, id, input));
        }
        self.make_room(rail, now);
    }

    /// Asks the pollers to park as many idle endpoints of `rail`, least recently wanted
    /// first, as there are endpoints waiting for room and no park already asked for.
    fn make_room(&mut self, rail: u16, now: Instant) {
        let waiting = self.room_wanted.iter().filter(|(r, ..)| *r == rail).count();
        let parking = self
            .active
            .iter()
            .filter(|((r, _), a)| *r == rail && a.parking.is_some())
            .count();
        let needed = waiting.saturating_sub(parking);
        if needed == 0 {
            return;
        }
        let mut candidates: Vec<(Instant, EndpointId, Epoch)> = self
            .active
            .iter()
            .filter(|((r, _), a)| {
                *r == rail
                    && !a.parked
                    && a.parking.is_none()
                    && !a.wants_room
                    && a.machine.phase() == Phase::Ready
            })
            .filter_map(|(&(_, id), a)| Some((a.last_wanted, id, a.machine.epoch()?)))
            .collect();
        candidates.sort_unstable_by_key(|&(wanted, id, _)| (wanted, id));
        for (_, id, epoch) in candidates.into_iter().take(needed) {
            if let Some(active) = self.active.get_mut(&(rail, id)) {
                active.parking = Some((epoch, now));
            }
            self.actions.push_back(Action::Command {
                rail,
                command: Command::Park {
                    endpoint: id,
                    epoch,
                },
            });
        }
    }

    /// The poller parked endpoint `id`: its queue pair of `epoch` is gone. If that is still
    /// the endpoint's queue pair, the target is told to drop its side and the endpoint
    /// connects again when traffic wants it (or when its state machine moves on); the room
    /// goes to the endpoints waiting for it.
    pub(super) fn parked(&mut self, rail: u16, id: EndpointId, epoch: Epoch, now: Instant) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        active.parking = None;
        if active.machine.epoch() == Some(epoch) && !active.parked {
            active.parked = true;
            active.view.set_parked(true);
            bump(&self.shared.counters.evictions);
            self.announce_retired_qp(rail, id, Some(epoch), now);
        }
        self.admit_waiting(rail, now);
    }

    /// The poller refused to park endpoint `id` (it was busy): it counts as just wanted, and
    /// the next candidate is asked at the next look ([`PARK_RETRY`]).
    pub(super) fn park_refused(&mut self, rail: u16, id: EndpointId, now: Instant) {
        if let Some(active) = self.active.get_mut(&(rail, id)) {
            active.parking = None;
            active.last_wanted = now;
        }
        bump(&self.shared.counters.eviction_refusals);
    }

    /// A slice arrived for parked endpoint `id`: it connects again when there is room. (An
    /// endpoint that is not ready — failed, backing off, its circuit open — connects again
    /// on its own, or fails what it is sent.)
    pub(super) fn wanted(&mut self, rail: u16, id: EndpointId, now: Instant) {
        // The poller says Wanted only after a park: if the Parked before it was folded into
        // this event (a full event ring keeps an endpoint's latest), it happened all the same.
        if let Some((epoch, _)) = self.active.get(&(rail, id)).and_then(|a| a.parking) {
            self.parked(rail, id, epoch, now);
        }
        let parked = self.active.get(&(rail, id)).is_some_and(|active| {
            active.parked && !active.wants_room && active.machine.phase() == Phase::Ready
        });
        if parked {
            self.acquire_queue_pair(rail, id, Input::Wake, now);
        }
    }

    /// Lets endpoints waiting for room on `rail` go, in order, while there is room.
    fn admit_waiting(&mut self, rail: u16, now: Instant) {
        while self.queue_pairs_on(rail) < self.policy.max_endpoints_per_rail {
            let Some(position) = self.room_wanted.iter().position(|(r, ..)| *r == rail) else {
                return;
            };
            let Some((rail, id, input)) = self.room_wanted.remove(position) else {
                return;
            };
            let still_wants = self.active.get(&(rail, id)).is_some_and(|active| {
                active.wants_room && active.machine.phase() != Phase::Retired
            });
            if still_wants {
                self.acquire_queue_pair(rail, id, input, now);
            }
        }
    }

    /// At each tick: room freed by retirements goes to the waiting endpoints, and every
    /// [`PARK_RETRY`] the idle endpoints still needed are asked to park (after refusals,
    /// parks that came too late, or when every endpoint was still connecting).
    pub(super) fn tend_room(&mut self, now: Instant) {
        if self.room_wanted.is_empty() {
            return;
        }
        // A park whose answer never came (its event folded into a later one) is forgotten:
        // the endpoint may be asked again.
        for active in self.active.values_mut() {
            if active
                .parking
                .is_some_and(|(_, asked)| now.duration_since(asked) > PARK_ANSWER_WAIT)
            {
                active.parking = None;
            }
        }
        // Forget waiters that retired meanwhile.
        let active = &self.active;
        self.room_wanted.retain(|(rail, id, _)| {
            active
                .get(&(*rail, *id))
                .is_some_and(|a| a.wants_room && a.machine.phase() != Phase::Retired)
        });
        let mut rails: Vec<u16> = self.room_wanted.iter().map(|(rail, ..)| *rail).collect();
        rails.sort_unstable();
        rails.dedup();
        for &rail in &rails {
            self.admit_waiting(rail, now);
        }
        if self.park_retry.is_none_or(|at| now >= at) {
            self.park_retry = Some(now + PARK_RETRY);
            for rail in rails {
                self.make_room(rail, now);
            }
        }
    }
}
