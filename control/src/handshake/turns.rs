//! Handshake admission: ConnectQps take turns on both sides, so a burst of them is worked
//! through in order instead of timing out and asking again (a reconnect storm).
//!
//! - **As a target**, ConnectQps are answered in arrival order, as they arrive while the
//!   driver's turn has room ([`Core::take_turns`]); the rest wait for the next turns
//!   ([`Core::answer_handshakes`]). Beyond the first
//!   [`Policy::max_handshakes_per_target`] waiting, the initiator is told at once
//!   (`ConnectQpQueued`) and stops its handshake timeout until the reply, up to
//!   [`Policy::handshake_queue_timeout`]: its turn comes however long the queue, and the
//!   ones near the front still time out if the target hangs. A newer ConnectQp for the same
//!   endpoint on the same connection replaces the one waiting (its initiator gave up on
//!   it), so waiting costs one entry per endpoint, and a RetireQp for the queue pair a
//!   waiting one offers takes it out of the queue (answered later, it would connect a
//!   queue pair its initiator has already taken out of service).
//! - **As an initiator**, at most [`Policy::max_handshakes_per_initiator`] ConnectQps are
//!   out at once; the rest wait here in order, their timeout stopped in the same way, and
//!   go out as replies come back.
//!
//! The accept path and the keepalives never wait behind a queue: the driver answers a
//! bounded number per turn of its loop and serves its sockets in between.
//!
//! [`Policy::max_handshakes_per_target`]: crate::policy::Policy::max_handshakes_per_target
//! [`Policy::handshake_queue_timeout`]: crate::policy::Policy::handshake_queue_timeout
//! [`Policy::max_handshakes_per_initiator`]: crate::policy::Policy::max_handshakes_per_initiator

use std::time::Instant;

use railyard_dataplane::sabotage::{self, Protection};
use railyard_dataplane::{EndpointId, Epoch};

use super::state::{ConnId, Core, Unanswered, Unsent};
use crate::endpoint::{Input, Phase};
use crate::rail::RailFabric;
use crate::shared::bump;
use crate::wire::{Message, QpSide, WireKey};

/// Whether handshakes take turns (off only with the `handshake-admission` sabotage switch:
/// every ConnectQp goes out at once, a target answers every one it received in order,
/// superseded, retired or not, and tells no initiator to wait).
fn admission_on() -> bool {
    !sabotage::is_off(Protection::HandshakeAdmission)
}

impl<F: RailFabric> Core<F> {
    /// From now on, at most `per_turn` ConnectQps are answered as they arrive between two
    /// calls of [`Self::answer_handshakes`]; the rest wait for those calls.
    pub(crate) fn take_turns(&mut self, per_turn: usize) {
        self.turn_budget = Some(per_turn);
    }

    /// A ConnectQp: answered now, or queued behind those that came first.
    pub(super) fn on_connect_qp(
        &mut self,
        conn: ConnId,
        key: WireKey,
        epoch: u64,
        handshake: u64,
        side: QpSide,
    ) {
        let room_this_turn = self
            .turn_budget
            .is_none_or(|budget| self.answered_this_turn < budget);
        if self.unanswered.is_empty() && room_this_turn {
            self.answered_this_turn += 1;
            return self.answer_connect_qp_on(conn, key, epoch, handshake, &side);
        }
        // The initiator replaced its attempt (it timed out or moved to a newer epoch): the
        // older one is answered by nobody's wish.
        if admission_on() {
            self.unanswered
                .retain(|waiting| !(waiting.conn == conn && waiting.key == key));
        }
        let from_this_connection = self
            .unanswered
            .iter()
            .filter(|waiting| waiting.conn == conn)
            .count();
        if from_this_connection >= self.policy.max_queue_pairs_per_peer
            || self.unanswered.len() >= self.policy.max_target_queue_pairs
        {
            bump(&self.shared.counters.refused);
            return self.send(
                conn,
                Message::ConnectQpReply {
                    key,
                    epoch,
                    handshake,
                    fence: self.fences.get(&key.initiator).copied().unwrap_or(0),
                    result: Err(format!(
                        "{from_this_connection} handshakes from this connection and {} in all \
                         wait here already",
                        self.unanswered.len()
                    )),
                },
            );
        }
        let ahead = self.unanswered.len();
        self.unanswered.push_back(Unanswered {
            conn,
            key,
            epoch,
            handshake,
            side,
        });
        if admission_on() && ahead >= self.policy.max_handshakes_per_target {
            bump(&self.shared.counters.handshakes_queued);
            self.send(
                conn,
                Message::ConnectQpQueued {
                    key,
                    epoch,
                    handshake,
                    ahead: u32::try_from(ahead).unwrap_or(u32::MAX),
                },
            );
        }
    }

    /// Takes the waiting ConnectQp that offers queue pair `qp_num` for `key` out of the
    /// queue (its initiator retired that queue pair before its turn came).
    pub(super) fn forget_unanswered(&mut self, key: WireKey, qp_num: u32) {
        if admission_on() {
            self.unanswered
                .retain(|waiting| !(waiting.key == key && waiting.side.info.qp_num == qp_num));
        }
    }

    /// ConnectQps waiting for their answer.
    pub(crate) fn handshakes_unanswered(&self) -> usize {
        self.unanswered.len()
    }

    /// Starts a turn: answers up to `budget` waiting ConnectQps, oldest first (those whose
    /// connection closed are dropped unanswered), and counts them against the turn. Returns
    /// how many it answered.
    pub(crate) fn answer_handshakes(&mut self, budget: usize) -> usize {
        self.answered_this_turn = 0;
        let mut answered = 0;
        while answered < budget {
            let Some(waiting) = self.unanswered.pop_front() else {
                break;
            };
            if !self.conns.contains_key(&waiting.conn) {
                continue;
            }
            answered += 1;
            self.answered_this_turn += 1;
            let span = self.conns[&waiting.conn].span.clone();
            let _entered = span.enter();
            self.answer_connect_qp_on(
                waiting.conn,
                waiting.key,
                waiting.epoch,
                waiting.handshake,
                &waiting.side,
            );
        }
        answered
    }

    /// The target queued this side's handshake: its endpoint waits for the reply beyond
    /// the connect timeout (up to the queue timeout).
    pub(super) fn on_connect_queued(
        &mut self,
        conn: ConnId,
        key: WireKey,
        (epoch, handshake): (u64, u64),
        now: Instant,
    ) {
        let Some((rail, id)) = self.waiting_endpoint(conn, key, epoch, handshake) else {
            bump(&self.shared.counters.stray_replies);
            return;
        };
        // Taken in by the target: it no longer holds one of this side's slots, so one busy
        // target cannot keep the handshakes to every other peer waiting.
        self.waiting_at_target.insert(handshake);
        self.handle_input(
            rail,
            id,
            Input::HandshakeQueued {
                epoch: Epoch::new(epoch),
            },
            now,
        );
    }

    /// Starts endpoint `id`'s handshake for `epoch`, or queues it behind the others if this
    /// side has as many out as it may.
    pub(super) fn start_handshake(
        &mut self,
        rail: u16,
        id: EndpointId,
        epoch: Epoch,
        woken: bool,
        now: Instant,
    ) {
        let full = self.handshakes_out() >= self.policy.max_handshakes_per_initiator
            || !self.unsent.is_empty();
        if !(admission_on() && full) {
            return self.create_qp(rail, id, epoch, woken, now);
        }
        bump(&self.shared.counters.handshakes_queued);
        self.unsent.push_back(Unsent {
            rail,
            id,
            epoch,
            woken,
        });
        if let Some(active) = self.active.get_mut(&(rail, id)) {
            active.machine.handle(Input::HandshakeQueued { epoch }, now);
        }
    }

    /// This side's handshakes awaiting their reply that count against its cap: all but
    /// those their target told to wait.
    fn handshakes_out(&mut self) -> usize {
        let handshakes = &self.handshakes;
        self.waiting_at_target
            .retain(|handshake| handshakes.contains_key(handshake));
        self.handshakes.len() - self.waiting_at_target.len()
    }

    /// Sends waiting handshakes while this side has fewer out than it may. One whose
    /// endpoint moved on (retired, timed out, another epoch) is dropped.
    pub(super) fn send_waiting_handshakes(&mut self, now: Instant) {
        while self.handshakes_out() < self.policy.max_handshakes_per_initiator {
            let Some(unsent) = self.unsent.pop_front() else {
                return;
            };
            let still_wanted = self.active.get(&(unsent.rail, unsent.id)).is_some_and(|a| {
                a.machine.phase() == Phase::Connecting
                    && a.machine.epoch() == Some(unsent.epoch)
                    && a.pending.is_none()
            });
            if !still_wanted {
                continue;
            }
            self.create_qp(unsent.rail, unsent.id, unsent.epoch, unsent.woken, now);
            let sent = self
                .active
                .get(&(unsent.rail, unsent.id))
                .and_then(|a| a.pending.as_ref())
                .is_some_and(|pending| pending.epoch == unsent.epoch);
            if sent {
                let input = Input::HandshakeSent {
                    epoch: unsent.epoch,
                };
                self.handle_input(unsent.rail, unsent.id, input, now);
            }
        }
    }
}
